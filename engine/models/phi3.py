"""Phi-3 / Phi-4-mini: the Llama layer, with q/k/v and gate/up stored FUSED in the checkpoint
(``qkv_proj`` = [q; k; v], ``gate_up_proj`` = [gate; up] — our parameters have those names, and
their weight loaders split a whole fused tensor into its parts before taking this rank's
shard), ``longrope`` scaling, partial rotary (``partial_rotary_factor``) and a sliding window on
every layer when ``sliding_window`` is set."""

from __future__ import annotations

from typing import Any, ClassVar

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


class Phi3ForCausalLM(CausalLM):
    # The checkpoint already uses our fused names; nothing to rename.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {}

    def build_model(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> nn.Module:
        norm = rms_norm_factory(hf, ops)

        def layer(i: int) -> nn.Module:
            attn = Attention(hf, ctx, ops, self.rotary(i), sliding_window=self.sliding_window(i))
            return PreNormDecoderLayer(attn, GatedMLP(hf, ctx, ops), norm)

        return DecoderModel(hf, ctx, layer, norm)
