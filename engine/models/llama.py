"""Llama-family decoders: Llama (with ``attention_bias`` / ``mlp_bias``), Mistral (sliding
window on every layer when ``sliding_window`` is set) and Qwen2 (q/k/v biases, tied
embeddings, sliding window from ``max_window_layers`` on with ``use_sliding_window``).

All three are the pre-norm layer of ``decoder`` with RMSNorm and a SiLU-gated MLP; the
differences are biases and which layers slide, both read from the HF config.
"""

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


class LlamaForCausalLM(CausalLM):
    def qkv_bias(self, hf: dict[str, Any]) -> bool:
        return bool(hf.get("attention_bias", False))

    def o_bias(self, hf: dict[str, Any]) -> bool:
        return bool(hf.get("attention_bias", False))

    def mlp_bias(self, hf: dict[str, Any]) -> bool:
        return bool(hf.get("mlp_bias", False))

    def build_model(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> nn.Module:
        norm = rms_norm_factory(hf, ops)

        def layer(i: int) -> nn.Module:
            attn = Attention(
                hf,
                ctx,
                ops,
                self.rotary(i),
                qkv_bias=self.qkv_bias(hf),
                o_bias=self.o_bias(hf),
                sliding_window=self.sliding_window(i),
            )
            return PreNormDecoderLayer(attn, GatedMLP(hf, ctx, ops, bias=self.mlp_bias(hf)), norm)

        return DecoderModel(hf, ctx, layer, norm)


class MistralForCausalLM(LlamaForCausalLM):
    """No biases anywhere (HF's Mistral has no bias switches)."""

    def qkv_bias(self, hf: dict[str, Any]) -> bool:
        return False

    def o_bias(self, hf: dict[str, Any]) -> bool:
        return False

    def mlp_bias(self, hf: dict[str, Any]) -> bool:
        return False


class Qwen2ForCausalLM(MistralForCausalLM):
    """Always q/k/v biases, never an o_proj or MLP bias."""

    def qkv_bias(self, hf: dict[str, Any]) -> bool:
        return True
