"""Model layers without parallelism in them: RMSNorm, rotary embedding, SiLU-and-mul, and the
paged attention layer that writes K/V into this layer's cache and attends through block tables.

Each layer computes through the ``KernelOps`` it was built with (torch or Triton, see
``kernels.backend``); the default is the torch backend.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kernels.attention import AttentionMetadata
from kernels.backend import KernelOps, get_kernel_ops


def default_ops(ops: KernelOps | None) -> KernelOps:
    return ops if ops is not None else get_kernel_ops("torch")


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 like HF's; ``forward(x, residual)`` fuses the residual add:
    returns (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float, ops: KernelOps | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.ops = default_ops(ops)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def _rope_inv_freq(head_dim: int, base: float, rope: dict[str, Any]) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"rope_scaling.rope_type: {rope_type!r} is not supported (default, linear, llama3)"
    )


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF's rotate_half), cos/sin cached for every position."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope: dict[str, Any],
        ops: KernelOps | None = None,
    ) -> None:
        super().__init__()
        self.ops = default_ops(ops)
        inv_freq = _rope_inv_freq(head_dim, base, rope)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, Hkv, D]
        return self.ops.rotary_embedding(positions, q, k, self.cos, self.sin)


class PagedAttention(nn.Module):
    """Writes this step's K/V at ``slot_mapping`` in this layer's cache, then attends each new
    token over its request's whole context through the block table. ``kv_cache`` is bound by
    the model runner once the cache is allocated."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, ops: KernelOps | None = None
    ) -> None:
        super().__init__()
        self.ops = default_ops(ops)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not allocated yet (initialize_cache first)")
        self.ops.reshape_and_cache(k, v, self.kv_cache, metadata.slot_mapping)
        return self.ops.paged_attention(q, self.kv_cache, metadata, self.scale)
