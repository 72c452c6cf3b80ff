"""Gemma 2 and Gemma 3 (text): four RMSNorms per layer (before and after attention, before and
after the MLP), Gemma's ``x * (1 + w)`` norm, embeddings scaled by sqrt(hidden_size), a
GELU-tanh gated MLP, attention scaled by ``query_pre_attn_scalar ** -0.5``, and tied
embeddings. Sliding-window and global layers alternate (``layer_types``).

Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``) and the final logits
(``final_logit_softcapping``). Gemma 3 adds a per-head q/k norm and gives sliding layers their
own rope base (``rope_local_base_freq``); it soft-caps only where its config says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.models.decoder import Attention, CausalLM, DecoderModel, GatedMLP
from engine.models.layers import GemmaRMSNorm
from llm_kernels.attention_metadata import AttentionMetadata
from llm_kernels.backend import KernelOps
from parallel.state import ParallelContext


class GemmaDecoderLayer(nn.Module):
    """``x += post_attn_norm(attn(input_norm(x)))``, then
    ``x += post_ff_norm(mlp(pre_ff_norm(x)))``. Returns (mlp branch, x) so that the stream
    stays ``hidden + residual`` as every decoder layer's contract says."""

    def __init__(self, self_attn: Attention, mlp: GatedMLP, hidden: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden if residual is None else residual + hidden
        attn = self.self_attn(positions, self.input_layernorm(x), metadata)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return self.post_feedforward_layernorm(mlp), x


class Gemma2ForCausalLM(CausalLM):
    tie_word_embeddings_default = True
    qk_norm = False

    def build_model(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> nn.Module:
        hidden = hf["hidden_size"]
        eps = hf.get("rms_norm_eps", 1e-6)
        scalar = hf.get("query_pre_attn_scalar")
        scale = float(scalar) ** -0.5 if scalar else None
        qk_norm = (lambda size: GemmaRMSNorm(size, eps)) if self.qk_norm else None

        def layer(i: int) -> nn.Module:
            attn = Attention(
                hf,
                ctx,
                ops,
                self.rotary(i),
                qkv_bias=bool(hf.get("attention_bias", False)),
                o_bias=bool(hf.get("attention_bias", False)),
                qk_norm=qk_norm,
                scale=scale,
                sliding_window=self.sliding_window(i),
                logits_soft_cap=hf.get("attn_logit_softcapping"),
            )
            return GemmaDecoderLayer(attn, GatedMLP(hf, ctx, ops), hidden, eps)

        return DecoderModel(
            hf, ctx, layer, lambda size: GemmaRMSNorm(size, eps), embed_scale=hidden**0.5
        )


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
