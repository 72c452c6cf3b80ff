"""One image of a request as the head records it and sends it to the workers, once, with the
request's first scheduled chunk (``NewRequestData.mm_features``; vLLM's
``MultiModalFeatureSpec``): where its placeholder tokens sit in the prompt, the hash of its
content (prefix-cache key and encoder-cache key) and its preprocessed pixels.

    prompt:   ... <s> USER : [img img img ... img] \\n What ...
                               ^ offset   length ^
    pixels:   float32 [C, H, W] as raw bytes (msgpack carries bytes as they are); Qwen2.5-VL:
              [patches, C * temporal_patch * patch * patch] and the patch grid (t, h, w)

Where a chunk may end when an image must be computed whole (``disable_chunked_mm_input``):
``stop_before_split_image`` (the scheduler's cut) and ``whole_image_prefix`` (a cache hit's).
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np


class MultiModalFeature(msgspec.Struct, kw_only=True, frozen=True):
    modality: str
    # sha256 (hex) of the preprocessed pixels and their shape: equal pixels, equal embeddings.
    mm_hash: str
    # The placeholder tokens [offset, offset + length) this item's embeddings replace.
    offset: int
    length: int
    pixel_values: bytes
    shape: tuple[int, ...]
    # Qwen2.5-VL: the image's (t, h, w) patch grid (its pixels are the patches, flattened, so
    # the shape alone does not give it); () for models whose pixels are an image.
    grid_thw: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its placeholder positions is in ``[start, end)``."""
        return self.offset < end and start < self.end

    def pixels(self) -> np.ndarray:
        return np.frombuffer(self.pixel_values, dtype=np.float32).reshape(self.shape)


def stop_before_split_image(features: list[MultiModalFeature], start: int, num_tokens: int) -> int:
    """How many of the ``num_tokens`` from ``start`` one chunk computes when it must not end
    inside an item's placeholder run (``disable_chunked_mm_input``): it stops before the item,
    which a later chunk computes whole."""
    end = start + num_tokens
    inside = [f.offset for f in features if f.offset < end < f.end]
    return max(min(inside) - start, 0) if inside else num_tokens


def whole_image_prefix(features: list[MultiModalFeature], num_tokens: int, block_size: int) -> int:
    """The longest prefix of at most ``num_tokens``, in whole blocks, that ends outside every
    item's placeholder run (it may end right before or right after one, never inside)."""
    end = num_tokens - num_tokens % block_size
    while True:
        inside = [f.offset for f in features if f.offset < end < f.end]
        if not inside:
            return end
        end = min(inside) - min(inside) % block_size


def image_feature(
    pixels: np.ndarray, offset: int, length: int, grid_thw: tuple[int, ...] = ()
) -> MultiModalFeature:
    """The record of one preprocessed image (``[C, H, W]``, or Qwen2.5-VL's flattened patches
    of ``grid_thw``) placed at ``offset``."""
    data = np.ascontiguousarray(pixels, dtype=np.float32)
    digest = hashlib.sha256(repr(data.shape).encode())
    if grid_thw:
        digest.update(repr(tuple(grid_thw)).encode())
    digest.update(data.tobytes())
    return MultiModalFeature(
        modality="image",
        mm_hash=digest.hexdigest(),
        offset=offset,
        length=length,
        pixel_values=data.tobytes(),
        shape=tuple(data.shape),
        grid_thw=tuple(int(g) for g in grid_thw),
    )
