"""Linear layers on CPU through oneDNN with the weight packed once, at load.

``F.linear`` on CPU re-reads the weight in its plain ``[out, in]`` layout every call (MKL sgemm
for fp32, a oneDNN call that reorders it for bf16). A decode step multiplies a few dozen rows by
every weight of the model, so that per-call cost is most of the GEMM: packing each weight once
into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the call inductor's
freezing pass and vLLM's CPU backend rely on) makes the decode-sized GEMMs 1.3-3x faster on the
machines measured (BENCHMARKS.md). The packed tensor is opaque; ``F.linear`` on the original
weight is the reference these are tested against (fp32 differs by rounding order, bf16 not at
all on the machines measured).

Used only where it works: CPU tensors, float32 or bfloat16, a torch built with oneDNN, and a
probe that compares it with ``F.linear`` once per dtype; the model loader packs every CPU model's
linear and expert weights where it works.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["pack_linear_weight", "packed_gemm_available", "packed_linear"]

logger = logging.getLogger("llm_cluster.kernels")

_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _probe(dtype: torch.dtype) -> bool:
    """Whether this torch packs and multiplies ``dtype`` weights correctly (checked once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 40, generator=generator).to(dtype)
        bias = torch.randn(48, generator=generator).to(dtype)
        x = torch.randn(3, 5, 40, generator=generator).to(dtype)
        got = packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(weight), bias)
    except (RuntimeError, AttributeError) as exc:  # a torch without the op or the dtype
        logger.info("packed CPU GEMM unavailable for %s: %s", dtype, exc)
        return False
    want = F.linear(x, weight, bias)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    return got.shape == want.shape and bool(
        torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    )


def packed_gemm_available(dtype: torch.dtype) -> bool:
    """Whether ``pack_linear_weight`` packs CPU weights of ``dtype``."""
    return dtype in _DTYPES and _probe(dtype)


def pack_linear_weight(weight: Tensor) -> Tensor | None:
    """``weight`` ``[out, in]`` in oneDNN's layout for :func:`packed_linear`, or None where the
    packed path does not cover it (not on CPU, not 2-D, another dtype, a torch without it)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if not packed_gemm_available(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for a weight packed by :func:`pack_linear_weight`; ``x`` is
    ``[..., in]`` in the weight's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
