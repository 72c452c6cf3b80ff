"""A worker's encoder-output cache: each image's embeddings (the vision tower + projector's
output), computed the first time a step reaches one of its placeholder tokens and kept while a
request that holds the image lives, so an image split across prefill chunks, or recomputed
after a preemption, is encoded once per request (and once for two live requests with the same
image). Keyed by the image's content hash (``MultiModalFeature.mm_hash``).

Per step (``ModelRunner.prepare_inputs``): for each request chunk ``[start, end)`` and each of its
images overlapping it, the rows ``[max(start, offset), min(end, offset + length))`` of the
packed batch take the image's embeddings at the same offsets into the image.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.multimodal.inputs import MultiModalFeature

# (pixels [N, ...]) or (pixels, grid_thw=(t, h, w)) -> embeddings [N, tokens, hidden].
Encoder = Callable[..., torch.Tensor]


class EncoderCache:
    """mm_hash -> embeddings ``[length, hidden]``, with the requests that hold each."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._outputs: dict[str, torch.Tensor] = {}
        self._holders: dict[str, set[str]] = {}
        self._features: dict[str, list[MultiModalFeature]] = {}
        self.num_encoded = 0  # images run through the encoder, for tests and metrics

    def __len__(self) -> int:
        return len(self._outputs)

    def add_request(self, req_id: str, features: list[MultiModalFeature]) -> None:
        if features:
            self._features[req_id] = list(features)

    def free_request(self, req_id: str) -> None:
        for feature in self._features.pop(req_id, ()):
            holders = self._holders.get(feature.mm_hash)
            if holders is None:
                continue
            holders.discard(req_id)
            if not holders:
                del self._holders[feature.mm_hash]
                del self._outputs[feature.mm_hash]

    def spans(self, req_id: str, start: int, end: int) -> list[tuple[int, int]]:
        """The placeholder spans of ``req_id``'s images that chunk ``[start, end)`` reaches."""
        return [(f.offset, f.end) for f in self._features.get(req_id, ()) if f.overlaps(start, end)]

    def gather(
        self,
        chunks: list[tuple[str, int, int, int]],
        encode: Encoder,
        dtype: torch.dtype,
    ) -> tuple[np.ndarray, torch.Tensor] | None:
        """For ``chunks`` (req_id, start, end, first packed row): the packed rows that hold
        image tokens and their embeddings, encoding (in one batch) the images not cached;
        None when no chunk reaches an image."""
        wanted: list[tuple[MultiModalFeature, str, int, int, int]] = []
        for req_id, start, end, row in chunks:
            for feature in self._features.get(req_id, ()):
                if feature.overlaps(start, end):
                    wanted.append((feature, req_id, start, end, row))
        if not wanted:
            return None
        self._encode_missing([w[0] for w in wanted], encode, dtype)
        rows, parts = [], []
        for feature, req_id, start, end, row in wanted:
            self._holders.setdefault(feature.mm_hash, set()).add(req_id)
            lo, hi = max(start, feature.offset), min(end, feature.end)
            rows.append(row + np.arange(lo - start, hi - start))
            parts.append(self._outputs[feature.mm_hash][lo - feature.offset : hi - feature.offset])
        return np.concatenate(rows), torch.cat(parts)

    def _encode_missing(
        self, features: list[MultiModalFeature], encode: Encoder, dtype: torch.dtype
    ) -> None:
        todo = {f.mm_hash: f for f in features if f.mm_hash not in self._outputs}
        if not todo:
            return
        # Images of one shape (and patch grid) in one batch (a tower takes one size; LLaVA's
        # are all equal; Qwen2.5-VL's encoder takes the grid too).
        by_shape: dict[tuple[tuple[int, ...], tuple[int, ...]], list[MultiModalFeature]] = {}
        for feature in todo.values():
            by_shape.setdefault((feature.shape, feature.grid_thw), []).append(feature)
        for (_, grid), group in by_shape.items():
            pixels = torch.from_numpy(np.stack([f.pixels() for f in group])).to(self.device, dtype)
            out = encode(pixels, grid_thw=grid) if grid else encode(pixels)
            for feature, embeds in zip(group, out):
                if embeds.shape[0] != feature.length:
                    raise RuntimeError(
                        f"image {feature.mm_hash[:12]} encodes to {embeds.shape[0]} embeddings "
                        f"but its prompt holds {feature.length} placeholder tokens"
                    )
                self._outputs[feature.mm_hash] = embeds
            self.num_encoded += len(group)
