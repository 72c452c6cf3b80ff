"""The CLIP vision transformer as VLMs use it (LLaVA): image -> patch features, for any
multimodal model that feeds a CLIP tower's hidden states to a projector.

    pixel_values [N, C, H, W] ─ patch conv (stride = patch) ─ [class | patches] + positions
        ─ pre_layrnorm ─ layers[0 : num_layers)  (pre-LN: x + attn(ln1(x)); x + mlp(ln2(x)))
        ─ hidden states [N, 1 + H/p * W/p, D]

``num_layers`` is how many encoder layers the caller reads (HF's ``vision_feature_layer``: the
layers past it and the final ``post_layernorm`` never affect a VLM, so they are not built).
Attention is bidirectional over one image's tokens (no KV cache). The tower is small next to
the language model and runs once per image, so it is replicated on every tensor-parallel rank
(plain ``nn.Linear``s, no collectives): each rank encodes the step's images itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def vision_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """HF's ``ACT2FN`` entries a CLIP tower or a LLaVA projector uses."""
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"hidden_act: {name!r} is not supported (quick_gelu, gelu, gelu_pytorch_tanh)")


def embed_patches(conv: nn.Conv2d, image_size: int, pixel_values: torch.Tensor) -> torch.Tensor:
    """``[N, C, H, W]`` -> ``[N, (H/p) * (W/p), D]`` through the patch ``conv`` (stride = patch),
    in the conv's dtype; images that are not ``image_size`` square are refused."""
    height, width = pixel_values.shape[-2:]
    if height != image_size or width != image_size:
        raise ValueError(
            f"pixel_values: images must be {image_size}x{image_size} (the tower's "
            f"image_size), got {height}x{width}"
        )
    return conv(pixel_values.to(conv.weight.dtype)).flatten(2).transpose(1, 2)


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        dim, patch = vision["hidden_size"], vision["patch_size"]
        self.image_size = vision["image_size"]
        self.class_embedding = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.patch_embedding = nn.Conv2d(
            vision.get("num_channels", 3), dim, kernel_size=patch, stride=patch, bias=False
        )
        num_positions = (self.image_size // patch) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = embed_patches(self.patch_embedding, self.image_size, pixel_values)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        dim = vision["hidden_size"]
        self.num_heads = vision["num_attention_heads"]
        self.head_dim = dim // self.num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, t, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, t, -1))


class CLIPMLP(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        self.act = vision_activation(vision["hidden_act"])
        self.fc1 = nn.Linear(vision["hidden_size"], vision["intermediate_size"])
        self.fc2 = nn.Linear(vision["intermediate_size"], vision["hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        dim, eps = vision["hidden_size"], vision.get("layer_norm_eps", 1e-5)
        self.self_attn = CLIPAttention(vision)
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.mlp = CLIPMLP(vision)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, vision: dict[str, Any], num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(vision) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """HF's ``CLIPVisionModel`` up to the output of encoder layer ``num_layers`` (0: the
    embeddings after ``pre_layrnorm``); parameter names are HF's."""

    def __init__(self, vision: dict[str, Any], num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(vision)
        eps = vision.get("layer_norm_eps", 1e-5)
        self.pre_layrnorm = nn.LayerNorm(vision["hidden_size"], eps=eps)
        self.encoder = CLIPEncoder(vision, num_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers:
            x = layer(x)
        return x
