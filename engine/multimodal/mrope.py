"""M-RoPE positions (Qwen2.5-VL): each prompt token's (t, h, w) rotary position, computed once
on the head when the request is processed, stored with the request and sent to the workers
with it (``NewRequestData.mrope``); the model runner reads any chunk ``[start, end)`` of it.

HF's ``get_rope_index`` for images: a text run continues one counter on all three axes; an
image of merged grid (t, h', w') = (t, h / merge, w / merge) starting at counter c gives its
token (i, j, k) the position (c + i, c + j, c + k), in the order the merger emits tokens (t,
then rows, then columns), and the counter moves on by max(h', w') — so the text after an image
is max(h', w') positions past the text before it, however many tokens the image had.

    delta = (largest position + 1) - number of prompt tokens
    position of token p >= the prompt's length (decode, recompute, speculative): p + delta
    on all three axes

Positions depend only on the tokens and the image grids before each token, which the prefix
cache's chained block hashes cover (an image's hash includes its grid), so a cached block's
positions are those a recompute would give.
"""

from __future__ import annotations

import msgspec
import numpy as np

from engine.multimodal.inputs import MultiModalFeature


class MRopePositions(msgspec.Struct, kw_only=True, frozen=True):
    # int64 [3, num_tokens] (t, h, w rows), C order, as raw bytes.
    positions: bytes
    num_tokens: int
    delta: int

    def array(self) -> np.ndarray:
        return np.frombuffer(self.positions, dtype=np.int64).reshape(3, self.num_tokens)

    def for_range(self, start: int, end: int) -> np.ndarray:
        """``[3, end - start]`` positions of tokens ``start .. end - 1``."""
        out = np.empty((3, end - start), dtype=np.int64)
        known = min(max(start, 0), self.num_tokens), min(end, self.num_tokens)
        n = max(known[1] - known[0], 0)
        out[:, :n] = self.array()[:, known[0] : known[1]]
        out[:, n:] = np.arange(start + n, end, dtype=np.int64) + self.delta
        return out


def mrope_positions(
    num_tokens: int, features: list[MultiModalFeature], spatial_merge_size: int
) -> MRopePositions:
    """The positions of a prompt of ``num_tokens`` whose images are ``features`` (each with
    its ``grid_thw``, in prompt order, over disjoint placeholder runs)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    pos = 0  # the next text token's position
    cursor = 0  # the next prompt token to place
    for feature in sorted(features, key=lambda f: f.offset):
        text = feature.offset - cursor
        out[:, cursor : feature.offset] = np.arange(pos, pos + text)
        pos += text
        t, h, w = feature.grid_thw
        h, w = h // spatial_merge_size, w // spatial_merge_size
        if t * h * w != feature.length:
            raise ValueError(
                f"image at {feature.offset}: grid {feature.grid_thw} merges to {t * h * w} "
                f"tokens, its placeholder run has {feature.length}"
            )
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
        out[:, feature.offset : feature.end] = grid.reshape(3, -1) + pos
        pos += max(h, w)
        cursor = feature.end
    out[:, cursor:] = np.arange(pos, pos + num_tokens - cursor)
    pos += num_tokens - cursor
    largest = int(out.max()) if num_tokens else -1
    return MRopePositions(
        positions=out.tobytes(), num_tokens=num_tokens, delta=largest + 1 - num_tokens
    )
