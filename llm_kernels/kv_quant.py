"""The FP8 KV cache's number format: which cache dtypes exist, how K/V are quantized on the
way into the cache and dequantized on the way out. Shared by the torch attention path (the
reference), the Triton kernels (which do the same arithmetic in-kernel) and the engine.

``kv_cache_dtype`` (vLLM's names): ``auto`` stores K/V in the model's dtype; ``fp8`` (alias
``fp8_e4m3``) stores them as ``float8_e4m3fn`` with one scale per tensor (per layer, one for
K and one for V) from the checkpoint (compressed-tensors' ``kv_cache_scheme`` writes
``self_attn.k_scale`` / ``v_scale``), else 1.0:

    store:  q = saturate(float32(x) / scale) -> float8_e4m3fn   (round to nearest even;
            saturate clamps to the format's finite range +-448, which it would otherwise leave
            as NaN)
    read:   x' = (float32(q) * scale) -> compute dtype

Both sides compute in float32 whatever the model dtype, so the torch path, the Triton kernels
and a plain-torch reference round every value the same way.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "FP8_DTYPE",
    "FP8_E4M3_MAX",
    "KV_CACHE_DTYPES",
    "as_storage",
    "check_kv_scale",
    "dequantize_kv",
    "is_fp8",
    "kv_cache_torch_dtype",
    "quantize_kv",
]

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3")
FP8_DTYPE = torch.float8_e4m3fn
# Largest finite float8_e4m3fn value.
FP8_E4M3_MAX = float(torch.finfo(FP8_DTYPE).max)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache tensors are allocated in."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    raise ValueError(
        f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
    )


def is_fp8(t: Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def check_kv_scale(name: str, scale: object) -> float:
    """A per-tensor K or V scale as a float: finite and > 0."""
    if isinstance(scale, Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"{name}: must be one value per tensor (kv_cache_scheme strategy 'tensor'), "
                f"got shape {list(scale.shape)}"
            )
        scale = float(scale.reshape(()).float())
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise ValueError(f"{name}: must be a number > 0, got {scale!r}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name}: must be a finite number > 0, got {scale!r}")
    return float(scale)


def quantize_kv(x: Tensor, scale: float) -> Tensor:
    """``x`` as float8_e4m3fn: divided by ``scale`` in float32 and saturated to +-448."""
    scaled = x.to(torch.float32) / scale
    return scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def dequantize_kv(q: Tensor, scale: float, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """float8 ``q`` back to ``dtype``: multiplied by ``scale`` in float32, then cast."""
    x = q.to(torch.float32)
    if scale != 1.0:
        x.mul_(scale)
    if out is None:
        return x.to(dtype)
    return out.copy_(x)


def as_storage(t: Tensor) -> Tensor:
    """A view that byte-moving ops accept: float8 as uint8 (CPU torch lacks ``index_copy_``
    for float8); other dtypes unchanged."""
    return t.view(torch.uint8) if is_fp8(t) else t
