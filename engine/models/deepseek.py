"""DeepSeek-V2 and DeepSeek-V3 (Kimi K2 is a DeepSeek-V3): multi-head latent attention
(``engine.models.mla``) on every layer, a dense gated MLP on the first ``first_k_dense_replace``
layers and DeepSeek's MoE on the others: routed experts chosen by DeepSeek's router
(``routing``) plus ``n_shared_experts`` ungated shared experts, one MLP of that many times
``moe_intermediate_size``.

    V2  softmax scores; top-k over all experts (``greedy``) or over the ``topk_group`` groups
        with the best expert (``group_limited_greedy``); weights x ``routed_scaling_factor``
    V3  sigmoid scores + ``e_score_correction_bias`` for the choice; top-k over the
        ``topk_group`` groups with the best sum of two (``noaux_tc``); the chosen experts'
        sigmoid scores renormalized (``norm_topk_prob``), x ``routed_scaling_factor``

HF's checkpoint names, with our module names: ``mlp.shared_experts`` is the block's
``shared_expert``; ``mlp.gate.weight`` / ``mlp.gate.e_score_correction_bias`` are the router's.
DeepSeek-V3 checkpoints append their multi-token-prediction layers after the last decoder layer
(``model.layers.{num_hidden_layers + i}.*`` for ``num_nextn_predict_layers``); they are not part
of the model and are skipped by name (``MoECausalLM.checkpoint_skipped``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from engine import hf_config
from engine.hf_config import config_field
from engine.models.decoder import DecoderModel, GatedMLP, PreNormDecoderLayer, rms_norm_factory
from engine.models.mla import MLAAttention
from engine.models.moe import MoECausalLM, Routing, SparseMoeBlock
from llm_kernels.backend import KernelOps
from parallel.state import ParallelContext


def deepseek_mlp(
    hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps, layer: int, routing: Routing
) -> nn.Module:
    """Layer ``layer``'s feed-forward in DeepSeek's layout (GLM-4.5's too): the routed experts
    plus ``n_shared_experts`` ungated shared experts on the sparse layers, a dense gated MLP on
    the first ``first_k_dense_replace``."""
    if not hf_config.is_sparse_layer(hf, layer):
        return GatedMLP(hf, ctx, ops)
    shared = int(config_field(hf, "n_shared_experts"))
    return SparseMoeBlock(
        hf,
        ctx,
        ops,
        routing=routing,
        shared_expert_intermediate_size=shared * hf_config.moe_intermediate_size(hf) or None,
        shared_expert_gated=False,
    )


class DeepseekV2ForCausalLM(MoECausalLM):
    renamed_modules: ClassVar[dict[str, str]] = {"shared_experts": "shared_expert"}
    # MLA's projections load as they are (its q_proj is not a fused q/k/v's part).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def routing(hf: dict[str, Any]) -> Routing:
        groups = config_field(hf, "topk_method") == "group_limited_greedy"
        return Routing(
            fp32_logits=True,
            fp32_weights=True,
            num_groups=int(config_field(hf, "n_group")) if groups else 1,
            topk_groups=int(config_field(hf, "topk_group")) if groups else 1,
            group_score="max",
            scaling_factor=float(config_field(hf, "routed_scaling_factor")),
        )

    @staticmethod
    def interleaved_rope(hf: dict[str, Any]) -> bool:
        return True  # V2's complex-number rope rotates interleaved pairs

    def build_model(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> nn.Module:
        norm = rms_norm_factory(hf, ops)
        routing = self.routing(hf)

        def layer(i: int) -> nn.Module:
            attn = MLAAttention(
                hf, ctx, ops, self.rotary(i), interleaved_rope=self.interleaved_rope(hf)
            )
            return PreNormDecoderLayer(attn, deepseek_mlp(hf, ctx, ops, i, routing), norm)

        return DecoderModel(hf, ctx, layer, norm)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @staticmethod
    def routing(hf: dict[str, Any]) -> Routing:
        return Routing(
            renormalize=bool(config_field(hf, "norm_topk_prob")),
            scoring="sigmoid",
            fp32_logits=True,
            fp32_weights=True,
            correction_bias=True,
            num_groups=int(config_field(hf, "n_group")),
            topk_groups=int(config_field(hf, "topk_group")),
            group_score="top2_sum",
            scaling_factor=float(config_field(hf, "routed_scaling_factor")),
        )

    @staticmethod
    def interleaved_rope(hf: dict[str, Any]) -> bool:
        return bool(config_field(hf, "rope_interleave"))
