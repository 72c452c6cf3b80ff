"""Qwen3: the Llama layer with a per-head RMSNorm on q and k before the rotary embedding, an
explicit ``head_dim`` (often != hidden_size / num_heads), ``attention_bias`` on q/k/v/o, and
Qwen2's sliding-window rule (``use_sliding_window``, from ``max_window_layers`` on)."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.models.decoder import (
    Attention,
    CausalLM,
    DecoderModel,
    GatedMLP,
    PreNormDecoderLayer,
    rms_norm_factory,
)
from llm_kernels.backend import KernelOps
from parallel.state import ParallelContext


class Qwen3ForCausalLM(CausalLM):
    def build_model(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> nn.Module:
        norm = rms_norm_factory(hf, ops)
        bias = bool(hf.get("attention_bias", False))

        def layer(i: int) -> nn.Module:
            attn = Attention(
                hf,
                ctx,
                ops,
                self.rotary(i),
                qkv_bias=bias,
                o_bias=bias,
                qk_norm=norm,
                sliding_window=self.sliding_window(i),
            )
            return PreNormDecoderLayer(attn, GatedMLP(hf, ctx, ops), norm)

        return DecoderModel(hf, ctx, layer, norm)
