"""Model layers without parallelism in them: RMSNorm (Llama's and Gemma's), and the paged
attention layer that writes K/V into this layer's cache and attends through block tables (with
an optional sliding window, logit soft-cap and attention sinks). Rotary embeddings are in
``rotary``.

Each layer computes through the ``KernelOps`` it was built with (torch or Triton, see
``llm_kernels.backend``); the default is the torch backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llm_kernels.attention_metadata import AttentionMetadata
from llm_kernels.backend import KernelOps, get_kernel_ops


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


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x * (offset + weight)`` with ``offset`` 1, normalized and scaled in
    float32 and cast back once (Llama's casts before scaling, so the two differ below float32);
    ``offset=0`` is gpt-oss's norm (a plain weight, applied in float32 as well). Same
    ``forward(x, residual)`` contract as :class:`RMSNorm`."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 1.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - offset), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (normed * (self.offset + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, x)


class PagedAttention(nn.Module):
    """Writes this step's K/V at ``slot_mapping`` in this layer's cache, then attends each new
    token over its request's context through the block table: all of it, or the last
    ``sliding_window`` positions (the token itself included) on a sliding-window layer; scores
    soft-capped (``cap * tanh(score / cap)``) when ``logits_soft_cap`` is set. ``kv_cache`` is
    bound by the model runner once the cache is allocated, in the shape ``kv_cache_shape``
    gives.

    ``sinks`` is None, or a model with attention sinks (gpt-oss) sets it to a float32
    ``[num_heads]`` parameter: one learned logit per query head that joins the softmax's
    denominator and has no value (``llm_kernels.attention.paged_attention``).

    With ``v_head_dim`` the cache is one latent plane (multi-head latent attention,
    ``engine.models.mla``): each token stores one ``head_dim`` vector per kv head, the key, whose
    first ``v_head_dim`` values are its value; ``forward`` takes no ``v`` and returns
    ``[num_tokens, num_heads, v_head_dim]``."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        ops: KernelOps | None = None,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        v_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.ops = default_ops(ops)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.v_head_dim = v_head_dim
        self.kv_cache: torch.Tensor | None = None
        # The KV cache group whose block table this layer reads (``engine.core.kv_cache_groups``),
        # set by the model runner with the cache.
        self.kv_cache_group = 0
        self.sinks: nn.Parameter | None
        self.register_parameter("sinks", None)
        # Per-tensor scales of an FP8 KV cache (``llm_kernels.kv_quant``): the checkpoint's
        # ``self_attn.k_scale`` / ``v_scale`` when it has them (set by the loader), else 1.0.
        # Plain floats, not parameters: a checkpoint without them loads strictly as before.
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def kv_planes(self) -> int:
        """2 (K, V), or 1 for a latent cache."""
        return 1 if self.v_head_dim is not None else 2

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """This layer's cache: ``[planes, num_blocks, block_size, num_kv_heads, head_dim]``."""
        return (self.kv_planes, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not allocated yet (initialize_cache first)")
        metadata = metadata.for_group(self.kv_cache_group)
        options: dict[str, Any] = {}
        if self.kv_cache.dtype == torch.float8_e4m3fn:
            options = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        self.ops.reshape_and_cache(k, v, self.kv_cache, metadata.slot_mapping, **options)
        if self.v_head_dim is not None:
            options["v_head_dim"] = self.v_head_dim
        if self.sliding_window is not None or self.logits_soft_cap is not None:
            options.update(sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap)
        if self.sinks is not None:
            options["sinks"] = self.sinks
        return self.ops.paged_attention(q, self.kv_cache, metadata, self.scale, **options)
