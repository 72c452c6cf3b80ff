"""Mixtral: Mistral's layer (no biases, a sliding window on every layer when
``sliding_window`` is set) with every MLP a sparse MoE block of ``num_local_experts`` experts,
``num_experts_per_tok`` per token, the top-k always renormalized and the routing weights kept in
float32. The checkpoint calls the block ``block_sparse_moe`` and the experts' projections
w1 (gate), w3 (up) and w2 (down)."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from engine.models.decoder import Attention, DecoderModel, PreNormDecoderLayer, rms_norm_factory
from engine.models.moe import MoECausalLM, Routing, SparseMoeBlock
from llm_kernels.backend import KernelOps
from parallel.state import ParallelContext


class MixtralForCausalLM(MoECausalLM):
    renamed_modules: ClassVar[dict[str, str]] = {"block_sparse_moe": "mlp"}

    def build_model(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> nn.Module:
        norm = rms_norm_factory(hf, ops)

        def layer(i: int) -> nn.Module:
            attn = Attention(hf, ctx, ops, self.rotary(i), sliding_window=self.sliding_window(i))
            routing = Routing(renormalize=True, fp32_weights=True)
            moe = SparseMoeBlock(hf, ctx, ops, routing=routing)
            return PreNormDecoderLayer(attn, moe, norm)

        return DecoderModel(hf, ctx, layer, norm)
