"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 attention (Qwen2-MoE's q/k/v biases behind
``qkv_bias``; Qwen3-MoE's q/k norm and ``attention_bias``) with a sparse MoE block on the layers
HF makes sparse (``decoder_sparse_step``, ``mlp_only_layers``) and a dense MLP of
``intermediate_size`` on the others. The top-k is renormalized only with ``norm_topk_prob``;
Qwen2-MoE adds its shared expert (``shared_expert_intermediate_size``) gated by
``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine import hf_config
from engine.models.decoder import (
    Attention,
    DecoderModel,
    GatedMLP,
    PreNormDecoderLayer,
    rms_norm_factory,
)
from engine.models.moe import MoECausalLM, Routing, SparseMoeBlock
from llm_kernels.backend import KernelOps
from parallel.state import ParallelContext


class Qwen2MoeForCausalLM(MoECausalLM):
    def attention(
        self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps, i: int
    ) -> Attention:
        return Attention(
            hf,
            ctx,
            ops,
            self.rotary(i),
            qkv_bias=bool(hf.get("qkv_bias", True)),
            sliding_window=self.sliding_window(i),
        )

    def shared_expert_size(self, hf: dict[str, Any]) -> int | None:
        return int(hf["shared_expert_intermediate_size"])

    def build_model(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> nn.Module:
        norm = rms_norm_factory(hf, ops)

        def layer(i: int) -> nn.Module:
            if hf_config.is_sparse_layer(hf, i):
                mlp: nn.Module = SparseMoeBlock(
                    hf,
                    ctx,
                    ops,
                    routing=Routing(renormalize=bool(hf.get("norm_topk_prob", False))),
                    shared_expert_intermediate_size=self.shared_expert_size(hf),
                )
            else:
                mlp = GatedMLP(hf, ctx, ops)
            return PreNormDecoderLayer(self.attention(hf, ctx, ops, i), mlp, norm)

        return DecoderModel(hf, ctx, layer, norm)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    def attention(
        self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps, i: int
    ) -> Attention:
        bias = bool(hf.get("attention_bias", False))
        return Attention(
            hf,
            ctx,
            ops,
            self.rotary(i),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=rms_norm_factory(hf, ops),
            sliding_window=self.sliding_window(i),
        )

    def shared_expert_size(self, hf: dict[str, Any]) -> int | None:
        return None
