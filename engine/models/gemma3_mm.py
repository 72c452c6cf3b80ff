"""Gemma 3 with vision (``Gemma3ForConditionalGeneration``): a SigLIP tower, Gemma 3's
multi-modal projector and the Gemma 3 language model, from a flattened config
(``engine.vlm_config``).

    image ─ SiglipVisionTower ─ [N, P*P patches, D] ─ avg pool (P/s)x(P/s) to s*s tokens
          ─ mm_soft_emb_norm (Gemma RMSNorm) ─ @ mm_input_projection_weight ─▶ embeddings
    prompt ─ embed_tokens * sqrt(hidden_size), with the image tokens' rows replaced by the
           image's embeddings (not scaled: HF scatters them after the scaling) ─ Gemma 3

The tower and the projector are replicated on every TP rank (small next to the language model;
no collectives), the language model is ``Gemma3ForCausalLM``'s TP-sharded code, so TP = 2
computes what TP = 1 does. One image's tokens attend to each other both ways on every layer
(HF's ``token_type_ids`` blocks: full layers see causal OR same-image keys, sliding layers the
same within their window); ``whole_image_attention`` tells the model runner to pass each
image's span to the attention metadata, and the scheduler keeps an image whole in one prefill
chunk. Checkpoint names as LLaVA's (``engine.models.llava.VLM_RENAMES``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.gemma import Gemma3ForCausalLM
from engine.models.layers import GemmaRMSNorm
from engine.models.llava import VLM_RENAMES, VLM_VISION_PREFIXES
from engine.models.siglip import SiglipVisionTower
from engine.models.vlm_checkpoint import VLMCheckpointNames
from llm_kernels.backend import KernelOps
from parallel.state import ParallelContext


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        vision = hf["vision_config"]
        dim = vision["hidden_size"]
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(dim, hf["hidden_size"]), requires_grad=False
        )
        self.mm_soft_emb_norm = GemmaRMSNorm(dim, vision.get("layer_norm_eps", 1e-6))
        self.patches_per_side = vision["image_size"] // vision["patch_size"]
        tokens_per_side = round(int(hf["mm_tokens_per_image"]) ** 0.5)
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, _, dim = features.shape
        side = self.patches_per_side
        grid = features.transpose(1, 2).reshape(n, dim, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        out = torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)
        return out.to(features.dtype)


class Gemma3ForConditionalGeneration(VLMCheckpointNames, Gemma3ForCausalLM):
    """The language model of ``Gemma3ForCausalLM`` plus ``vision_tower`` and
    ``multi_modal_projector``."""

    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = VLM_RENAMES
    vision_prefixes: ClassVar[tuple[str, ...]] = VLM_VISION_PREFIXES

    # One image's tokens attend to each other both ways (see the module docstring).
    whole_image_attention: ClassVar[bool] = True

    def __init__(
        self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps | None = None
    ) -> None:
        super().__init__(hf, ctx, ops)
        self.vision_tower = SiglipVisionTower(hf["vision_config"])
        self.multi_modal_projector = Gemma3MultiModalProjector(hf)
        self.embed_scale = float(hf["hidden_size"]) ** 0.5

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[num_images, C, H, W]`` -> ``[num_images, mm_tokens_per_image, hidden_size]``."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings scaled as ``DecoderModel`` scales them (in the model dtype)."""
        hidden = self.model.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    # ---- checkpoint names ---------------------------------------------------------------

    def checkpoint_skipped(self, name: str) -> bool:
        """SigLIP's attention-pooling head, which a VLM never reads."""
        return self.checkpoint_name(name).startswith("vision_tower.head.")
