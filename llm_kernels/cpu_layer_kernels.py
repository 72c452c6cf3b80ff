"""The ``cpu`` kernel backend's per-layer kernels besides decode attention, one native call each
(``csrc/cpu_layer_kernels.cpp``): RMSNorm with its residual add, the rotary embedding, and the
KV cache write.

At batch 1 a decode step on CPU runs ~1,500 torch ops; RMSNorm (9 ops, twice a layer), the rotary
embedding (~20 ops) and the cache write (its mask of skipped slots, ~6 ops) are about a sixth of
the step's time, mostly dispatch (BENCHMARKS.md, "Native RMSNorm, rotary and cache write on
CPU"). ``rms_norm`` and ``rotary_embedding`` have the contracts of ``llm_kernels.ops``' and round
where those round, so the rotary embedding equals the torch path bit for bit and RMSNorm differs
only in the order its sum of squares is added (as the packed GEMM differs from ``F.linear``);
``write_cache_rows`` is the byte copy behind ``llm_kernels.attention.reshape_and_cache``. Calls
the native code does not cover (another dtype or device, a layout it does not take, an FP8
cache) go to the torch path. The C++ builds once, without instruction-set flags, so one binary
runs on every x86-64 CPU; where it cannot build, :func:`available` says so (logged once) and
the ``cpu`` backend keeps the torch functions.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
from torch import Tensor

from llm_kernels import ops
from llm_kernels.native_build import build_extension

__all__ = ["available", "rms_norm", "rotary_embedding", "write_cache_rows"]

logger = logging.getLogger("llm_cluster.kernels")

_DTYPES = (torch.float32, torch.bfloat16)
# A byte copy: any cache but FP8, whose rows are quantized on the way in.
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# No contraction into FMAs: the torch path rounds each product on its own.
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]


@functools.cache
def _module() -> ModuleType | None:
    try:
        return build_extension("llm_cluster_cpu_layer_kernels", "cpu_layer_kernels.cpp", _FLAGS)
    except Exception as exc:  # any build failure means "use the torch functions"
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        logger.warning(
            "native CPU RMSNorm/rotary/cache write unavailable (%s: %s); using torch",
            type(exc).__name__,
            detail,
        )
        return None


def available() -> bool:
    """Whether the native functions run here (builds them on the first call)."""
    return _module() is not None


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """``llm_kernels.ops.rms_norm``: ``weight * normalize(x)`` over the last dim; with
    ``residual`` ``(norm(x + residual), x + residual)``."""
    module = _module()
    if (
        module is None
        or x.device.type != "cpu"
        or x.dtype not in _DTYPES
        or weight.dtype != x.dtype
        or weight.device.type != "cpu"
        or weight.dim() != 1
        or x.dim() == 0
        or weight.shape[0] != x.shape[-1]
        or not x.is_contiguous()
        or not weight.is_contiguous()
        or (
            residual is not None
            and (
                residual.dtype != x.dtype
                or residual.shape != x.shape
                or residual.device.type != "cpu"
                or not residual.is_contiguous()
            )
        )
    ):
        return ops.rms_norm(x, weight, eps, residual)
    result = module.rms_norm(x, weight, residual, float(eps))
    return result[0] if residual is None else (result[0], result[1])


def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor]:
    """``llm_kernels.ops.rotary_embedding``: neox-style rotary of ``query`` ``[T, H, D]`` and
    ``key`` ``[T, Hkv, D]`` by float32 ``cos``/``sin`` ``[max_position, D]``; new contiguous
    tensors."""
    module = _module()
    width = query.shape[-1] if query.dim() == 3 else -1
    if (
        module is None
        or width % 2 != 0
        or positions.dtype != torch.int64
        or positions.dim() != 1
        or not positions.is_contiguous()
        or any(t.device.type != "cpu" for t in (positions, query, key, cos, sin))
        or any(t.dtype != torch.float32 or not t.is_contiguous() for t in (cos, sin))
        or cos.shape != sin.shape
        or cos.dim() != 2
        or cos.shape[1] != width
        or any(
            t.dtype not in _DTYPES
            or t.dim() != 3
            or t.shape[0] != positions.shape[0]
            or t.shape[2] != width
            or t.stride(2) != 1
            for t in (query, key)
        )
    ):
        return ops.rotary_embedding(positions, query, key, cos, sin)
    return module.rotary(positions, query, cos, sin), module.rotary(positions, key, cos, sin)


def write_cache_rows(
    key: Tensor, value: Tensor | None, kv_cache: Tensor, slot_mapping: Tensor
) -> bool:
    """Copy ``key`` (and ``value``) rows ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping``
    (slots < 0 skipped) and return True; False, with nothing written, where this does not cover
    the call (``llm_kernels.attention.CacheWriter``: the caller checked the arguments already
    and writes them itself then)."""
    module = _module()
    if (
        module is None
        or kv_cache.device.type != "cpu"
        or kv_cache.dtype not in _CACHE_DTYPES
        or not kv_cache.is_contiguous()
        or key.stride(2) != 1
        or (value is not None and value.stride(2) != 1)
    ):
        return False
    module.cache_write(key, value, kv_cache, slot_mapping)
    return True
