"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector and a
Llama / Mistral language model, from a flattened config (``engine.vlm_config``).

    image ─ CLIPVisionTower (up to vision_feature_layer) ─ [drop class token: "default"]
          ─ linear_1 ─ act ─ linear_2 ─▶ one embedding per image token
    prompt ─ embed_tokens, with the image tokens' rows replaced by the image's embeddings
           ─ the Llama decoder ─ LM head

The language model is ``LlamaForCausalLM``'s code (a Mistral config has no bias switches, so it
builds the same layers); the tower and the projector are replicated on every TP rank. The
model runner calls ``embed_multimodal`` once per image (``engine.worker.encoder_cache``) and
passes the merged embeddings as ``inputs_embeds``.

Checkpoint names come in three layouts (hub: ``language_model.model.*``,
``vision_tower.vision_model.*``; transformers >= 4.52: ``model.language_model.*``,
``model.vision_tower.*``; transformers 5's save: ``vision_tower.*`` without ``vision_model``);
``VLMCheckpointNames`` (``engine.models.vlm_checkpoint``) maps each to this module's names.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from engine.models.clip import CLIPVisionTower, vision_activation
from engine.models.llama import LlamaForCausalLM
from engine.models.vlm_checkpoint import VLMCheckpointNames
from engine.vlm_config import feature_layer
from llm_kernels.backend import KernelOps
from parallel.state import ParallelContext

# Checkpoint prefix -> ours, first match wins (the loader may have prefixed "model." to a
# checkpoint with no "model." names at all).
VLM_RENAMES: tuple[tuple[str, str], ...] = (
    ("model.language_model.model.", "model."),
    ("model.language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.", "model."),
    ("vision_tower.vision_model.", "vision_tower."),
)
VLM_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        bias = bool(hf.get("multimodal_projector_bias", True))
        vision_dim, text_dim = hf["vision_config"]["hidden_size"], hf["hidden_size"]
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.act = vision_activation(hf["projector_hidden_act"])
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(VLMCheckpointNames, LlamaForCausalLM):
    """The language model of ``LlamaForCausalLM`` plus ``vision_tower`` and
    ``multi_modal_projector``."""

    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = VLM_RENAMES
    vision_prefixes: ClassVar[tuple[str, ...]] = VLM_VISION_PREFIXES

    def __init__(
        self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps | None = None
    ) -> None:
        super().__init__(hf, ctx, ops)
        self.num_vision_layers = feature_layer(hf)
        self.vision_tower = CLIPVisionTower(hf["vision_config"], self.num_vision_layers)
        self.multi_modal_projector = LlavaMultiModalProjector(hf)
        self.drop_class_token = hf.get("vision_feature_select_strategy") == "default"

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[num_images, C, H, W]`` -> ``[num_images, tokens per image, hidden_size]``."""
        features = self.vision_tower(pixel_values)
        if self.drop_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    # ---- checkpoint names ---------------------------------------------------------------

    def checkpoint_skipped(self, name: str) -> bool:
        """The tower's parts a LLaVA never reads: ``post_layernorm`` and the encoder layers
        past ``vision_feature_layer``."""
        name = self.checkpoint_name(name)
        if name.startswith("vision_tower.post_layernorm."):
            return True
        prefix = "vision_tower.encoder.layers."
        if name.startswith(prefix):
            return int(name[len(prefix) :].split(".", 1)[0]) >= self.num_vision_layers
        return False
