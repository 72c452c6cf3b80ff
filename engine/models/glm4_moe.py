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

from engine.hf_config import config_field
from engine.models.decoder import (
    Attention,
    DecoderModel,
    PreNormDecoderLayer,
    rms_norm_factory,
)
from engine.models.deepseek import DeepseekV3ForCausalLM, deepseek_mlp
from engine.models.moe import MoECausalLM
from llm_kernels.backend import KernelOps
from parallel.state import ParallelContext


class Glm4MoeForCausalLM(MoECausalLM):
    renamed_modules: ClassVar[dict[str, str]] = {"shared_experts": "shared_expert"}

    def build_model(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> nn.Module:
        norm = rms_norm_factory(hf, ops)
        bias = bool(config_field(hf, "attention_bias"))
        qk_norm = norm if config_field(hf, "use_qk_norm") else None
        routing = DeepseekV3ForCausalLM.routing(hf)

        def layer(i: int) -> nn.Module:
            attn = Attention(hf, ctx, ops, self.rotary(i), qkv_bias=bias, qk_norm=qk_norm)
            return PreNormDecoderLayer(attn, deepseek_mlp(hf, ctx, ops, i, routing), norm)

        return DecoderModel(hf, ctx, layer, norm)
