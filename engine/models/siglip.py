"""The SigLIP vision transformer as Gemma 3 uses it: image -> the last layer's patch features
after ``post_layernorm`` (HF's ``SiglipVisionModel.last_hidden_state``).

    pixel_values [N, C, H, W] ─ patch conv (stride = patch, with bias) + positions
        ─ encoder layers (CLIP's: x + attn(ln1(x)); x + mlp(ln2(x)))
        ─ post_layernorm ─▶ [N, (H/p) * (W/p), D]

No class token and no pre-norm (CLIP's differences); the attention-pooling ``head`` is never
read by a VLM and not built. Attention is bidirectional over one image's patches. Like the
CLIP tower, it is replicated on every tensor-parallel rank (plain ``nn.Linear``s, no
collectives): each rank encodes the step's images itself, so TP = 2 computes what TP = 1 does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.models.clip import CLIPEncoder, embed_patches


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        dim, patch = vision["hidden_size"], vision["patch_size"]
        self.image_size = vision["image_size"]
        self.patch_embedding = nn.Conv2d(
            vision.get("num_channels", 3), dim, kernel_size=patch, stride=patch
        )
        self.position_embedding = nn.Embedding((self.image_size // patch) ** 2, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = embed_patches(self.patch_embedding, self.image_size, pixel_values)
        return patches + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """HF's ``SiglipVisionModel`` without its pooling head; parameter names are HF's."""

    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(vision)
        self.encoder = CLIPEncoder(vision, vision["num_hidden_layers"])
        eps = vision.get("layer_norm_eps", 1e-6)
        self.post_layernorm = nn.LayerNorm(vision["hidden_size"], eps=eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
