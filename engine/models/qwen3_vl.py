"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): the vision model of
``engine.models.qwen3_vision`` and a Qwen3 language model with interleaved M-RoPE (the
positions and their head-side computation are Qwen2.5-VL's, ``engine.models.qwen2_5_vl``).

    image ─ visual (replicated) ─▶ per image token: [embedding | deepstack_0 | ... | deepstack_k-1]
    prompt ─ embed_tokens, image tokens' rows replaced by the embedding
           ─ decoder layer i, then (i < k) the image tokens' rows of the residual stream
             += deepstack_i ─ ... ─ norm ─ LM head

Deepstack: the encoder cache keeps each image token's row whole (``hidden * (1 + k)`` wide);
the model runner puts its first ``hidden`` values in the input embeddings and hands the rest,
with the rows they belong to, to ``forward`` (``deepstack``), so a chunk that holds part of
an image adds exactly that part. The stream is summed as HF sums it (the layer's output plus
its residual, then the visual features) before the next layer reads it.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.qwen2_5_vl import QwenVLMixin
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_vision import Qwen3VisionModel
from llm_kernels.attention_metadata import AttentionMetadata
from llm_kernels.backend import KernelOps
from parallel.state import ParallelContext


class Qwen3VLForConditionalGeneration(QwenVLMixin, Qwen3ForCausalLM):
    """``Qwen3ForCausalLM`` with interleaved M-RoPE and deepstack, plus ``visual``."""

    def __init__(
        self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps | None = None
    ) -> None:
        super().__init__(hf, ctx, ops)
        self.visual = Qwen3VisionModel(hf["vision_config"])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``deepstack``: (packed rows of this step's image tokens, their deepstack features
        ``[rows, hidden * k]``), with ``inputs_embeds``."""
        if deepstack is None or inputs_embeds is None:
            return self.model(input_ids, positions, metadata, hidden, residual, inputs_embeds)
        rows, features = deepstack
        width = inputs_embeds.shape[-1]
        model = self.model
        hidden, residual = inputs_embeds, None
        for i, layer in enumerate(model.layers.values()):
            hidden, residual = layer(positions, hidden, residual, metadata)
            if (i + 1) * width <= features.shape[-1]:
                stream = residual + hidden
                part = features[:, i * width : (i + 1) * width].to(stream.dtype)
                stream[rows] = stream[rows] + part
                hidden, residual = stream, None
        if residual is None:
            return model.norm(hidden), None
        return model.norm(hidden, residual)[0], None
