"""Multi-head latent attention (MLA), the attention of DeepSeek-V2 and V3 (and Kimi K2): keys
and values come from one low-rank latent per token, and only that latent is cached.

    x ─ q_a_proj ─ q_a_layernorm ─ q_b_proj ─┬ q_nope [H, nope] ─ x W_UK ─┐    (or plain q_proj)
                                              └ q_pe   [H, rope] ─ rope ──┴ q [H, kv_lora + rope]
    x ─ kv_a_proj_with_mqa ─┬ c_kv [kv_lora] ─ kv_a_layernorm ─┐
                            └ k_pe [rope] ─ rope ──────────────┴ latent [1, kv_lora + rope] ─▶ cache
    PagedAttention over the latent cache, one "kv head" (MQA): scores q · latent, values the
    latent's first kv_lora values ─ o_latent [H, kv_lora] ─ x W_UV^T ─ [H, v] ─ o_proj

``kv_b_proj`` is read as W_UK / W_UV, absorbed in every phase (docs/mla.md says why, what it
costs a long prefill, and how the rope permutation, softmax scale and latent norms match HF).
Tensor parallel: heads split; the latent projections and the latent cache whole on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.hf_config import config_field
from engine.models.layers import PagedAttention, RMSNorm
from engine.models.rotary import RotaryEmbedding
from llm_kernels.attention_metadata import AttentionMetadata
from llm_kernels.backend import KernelOps
from parallel.layers import ColumnParallelLinear, RowParallelLinear, divide
from parallel.state import SINGLE, GroupCoordinator, ParallelContext

# HF builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps.
_LATENT_NORM_EPS = 1e-6


class LatentUpProjection(ColumnParallelLinear):
    """``kv_b_proj``: loaded like any column-parallel weight (this rank's heads), but never
    applied as a matmul of its own: MLA reads it as the absorbed W_UK / W_UV, so it stays a
    dense tensor in the model's dtype (``dense_only``): never packed into oneDNN's layout, and
    dequantized at load from a quantized checkpoint on any device.

    The checkpoint's rows are each head's ``nope`` key rows then its ``v`` value rows; once
    loaded they are stored regrouped, every head's key rows first, so that :meth:`absorbed`
    returns two contiguous ``[H, *, kv_lora]`` tensors: a batched matmul over strided views of
    the interleaved layout copies both matrices on every call (15 % of a bf16 decode step of
    the DeepSeek-V3 bench model on CPU, BENCHMARKS.md)."""

    dense_only = True

    def __init__(
        self, kv_lora_rank: int, num_heads: int, nope_dim: int, v_dim: int, *, tp: GroupCoordinator
    ) -> None:
        super().__init__(kv_lora_rank, num_heads * (nope_dim + v_dim), tp=tp)
        self.nope_dim, self.v_dim = nope_dim, v_dim
        self.local_heads = divide(num_heads, tp.size, "num_attention_heads")

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        super().weight_loader(param, loaded, shard_id)
        rows = param.data.view(self.local_heads, self.nope_dim + self.v_dim, -1)
        regrouped = torch.cat(
            [
                rows[:, : self.nope_dim].reshape(-1, rows.shape[-1]),
                rows[:, self.nope_dim :].reshape(-1, rows.shape[-1]),
            ]
        )
        param.data.copy_(regrouped)

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's W_UK ``[H, nope, kv_lora]`` and W_UV ``[H, v, kv_lora]``, contiguous
        views of the regrouped weight."""
        w = self.weight
        split = self.local_heads * self.nope_dim
        return w[:split].view(self.local_heads, self.nope_dim, -1), w[split:].view(
            self.local_heads, self.v_dim, -1
        )


def softmax_scale(hf: dict[str, Any]) -> float:
    """``qk_head_dim ** -0.5``, times yarn's ``mscale(factor, mscale_all_dim) ** 2`` when the
    rope is scaled and ``mscale_all_dim`` is set (HF's ``yarn_apply_mscale``)."""
    qk_head_dim = config_field(hf, "qk_nope_head_dim") + config_field(hf, "qk_rope_head_dim")
    scale = qk_head_dim**-0.5
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    mscale_all_dim = rope.get("mscale_all_dim") or 0
    factor = float(rope.get("factor") or 1.0)
    if rope_type != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAAttention(nn.Module):
    """Multi-head latent attention over the paged latent cache (see the module docstring)."""

    def __init__(
        self,
        hf: dict[str, Any],
        ctx: ParallelContext,
        ops: KernelOps,
        rotary: RotaryEmbedding,
        *,
        interleaved_rope: bool,
    ) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        bias = bool(config_field(hf, "attention_bias"))
        self.q_lora_rank: int | None = config_field(hf, "q_lora_rank")
        self.kv_lora_rank = int(config_field(hf, "kv_lora_rank"))
        self.nope_dim = int(config_field(hf, "qk_nope_head_dim"))
        self.rope_dim = int(config_field(hf, "qk_rope_head_dim"))
        self.v_dim = int(config_field(hf, "v_head_dim"))
        qk_head_dim = self.nope_dim + self.rope_dim
        self.num_heads = divide(heads, ctx.tp.size, "num_attention_heads")
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_head_dim, tp=ctx.tp)
        else:
            self.q_a_proj = ColumnParallelLinear(hidden, self.q_lora_rank, bias=bias, tp=SINGLE)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS, ops)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_head_dim, tp=ctx.tp)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            hidden, self.kv_lora_rank + self.rope_dim, bias=bias, tp=SINGLE
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS, ops)
        self.kv_b_proj = LatentUpProjection(
            self.kv_lora_rank, heads, self.nope_dim, self.v_dim, tp=ctx.tp
        )
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias, tp=ctx.tp)
        self.rotary = rotary
        # Even dimensions, then odd: DeepSeek's interleaved pairs as neox halves.
        order = None
        if interleaved_rope:
            order = torch.arange(self.rope_dim).view(-1, 2).t().reshape(-1)
        self.register_buffer("rope_order", order, persistent=False)
        self.attn = PagedAttention(
            self.num_heads,
            1,
            self.kv_lora_rank + self.rope_dim,
            ops,
            scale=softmax_scale(hf),
            v_head_dim=self.kv_lora_rank,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        tokens = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        k_pe = k_pe.reshape(tokens, 1, self.rope_dim)
        if self.rope_order is not None:
            q_pe = q_pe.index_select(-1, self.rope_order)
            k_pe = k_pe.index_select(-1, self.rope_order)
        q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.contiguous())
        w_uk, w_uv = self.kv_b_proj.absorbed()
        # [H, T, nope] @ [H, nope, kv_lora]: each head's query in the latent's space.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat([q_latent, q_pe], dim=-1)
        latent = torch.cat([c_kv, k_pe.view(tokens, self.rope_dim)], dim=-1).view(tokens, 1, -1)
        o_latent = self.attn(query, latent, None, metadata)
        # [H, T, kv_lora] @ [H, kv_lora, v]: each head's value projection, after attention.
        out = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2))
        return self.o_proj(out.transpose(0, 1).reshape(tokens, self.num_heads * self.v_dim))


__all__ = ["LatentUpProjection", "MLAAttention", "softmax_scale"]
