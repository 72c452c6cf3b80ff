"""Pointwise model ops in plain torch: the CPU path and the reference for
``llm_kernels.triton_ops``.

Numerics follow HF transformers (what the engine is checked against): RMSNorm normalizes in
float32 and multiplies by the weight in the input dtype; rotary, SiLU-and-mul and
GELU-tanh-and-mul compute in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["gelu_tanh_and_mul", "rms_norm", "rotary_embedding", "silu_and_mul"]


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """``weight * normalize(x)`` over the last dim; with ``residual`` it first adds it and
    returns ``(norm(x + residual), x + residual)``."""
    if residual is not None:
        x = x + residual
    x32 = x.to(torch.float32)
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor]:
    """Neox-style rotary embedding (HF's ``rotate_half``) of ``query`` ``[T, H, D]`` and
    ``key`` ``[T, Hkv, D]``; ``cos``/``sin`` are float32 ``[max_position, D]`` (both halves
    repeated)."""
    cos_t = cos[positions].unsqueeze(1).to(query.dtype)
    sin_t = sin[positions].unsqueeze(1).to(query.dtype)
    return query * cos_t + _rotate_half(query) * sin_t, key * cos_t + _rotate_half(key) * sin_t


def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """``gelu(gate, approximate="tanh") * up`` for ``x = [gate | up]`` along the last dim
    (Gemma's MLP; HF's ``gelu_pytorch_tanh``)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
