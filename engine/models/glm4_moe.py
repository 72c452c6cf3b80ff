"""GLM-4.5, GLM-4.5-Air and GLM-4.6 (``Glm4MoeForCausalLM``): grouped-query attention with
q/k/v biases (``attention_bias``; o_proj never has one), an optional per-head RMSNorm on q and
k before the rotary embedding (``use_qk_norm``), and rope on the first ``partial_rotary_factor``
of each head (half by default, HF's rotate-half layout); a dense gated MLP on the first
``first_k_dense_replace`` layers and, on the others, DeepSeek-V3's MoE: the router of
``DeepseekV3ForCausalLM`` (sigmoid scores, ``e_score_correction_bias`` for the choice, the
``topk_group`` best of ``n_group`` groups scored by their best two, renormalized with
``norm_topk_prob``, times ``routed_scaling_factor``) plus ``n_shared_experts`` ungated shared
experts. Checkpoint names are DeepSeek's (``mlp.shared_experts``, ``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``), and the multi-token-prediction layers GLM appends after
the last decoder layer are skipped by name (``MoECausalLM.checkpoint_skipped``)."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from engine import hf_config
from engine.hf_config import config_field
from engine.models.decoder import (
    Attention,
    DecoderModel,
    GatedMLP,
    PreNormDecoderLayer,
    rms_norm_factory,
)
from engine.models.deepseek import DeepseekV3ForCausalLM
from engine.models.moe import MoECausalLM, SparseMoeBlock
from kernels.backend import KernelOps
from parallel.state import ParallelContext


class Glm4MoeForCausalLM(MoECausalLM):
    renamed_modules: ClassVar[dict[str, str]] = {"shared_experts": "shared_expert"}

    def build_model(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> nn.Module:
        norm = rms_norm_factory(hf, ops)
        bias = bool(config_field(hf, "attention_bias"))
        qk_norm = norm if config_field(hf, "use_qk_norm") else None
        shared = int(config_field(hf, "n_shared_experts"))
        shared_size = shared * hf_config.moe_intermediate_size(hf) if shared else None
        routing = DeepseekV3ForCausalLM.routing(hf)

        def layer(i: int) -> nn.Module:
            attn = Attention(hf, ctx, ops, self.rotary(i), qkv_bias=bias, qk_norm=qk_norm)
            if hf_config.is_sparse_layer(hf, i):
                mlp: nn.Module = SparseMoeBlock(
                    hf,
                    ctx,
                    ops,
                    routing=routing,
                    shared_expert_intermediate_size=shared_size,
                    shared_expert_gated=False,
                )
            else:
                mlp = GatedMLP(hf, ctx, ops)
            return PreNormDecoderLayer(attn, mlp, norm)

        return DecoderModel(hf, ctx, layer, norm)
