"""Qwen3-VL's vision transformer: an image's flattened patches and its (t, h, w) patch grid
-> one embedding per merged 2x2 square of patches, plus one "deepstack" embedding per square
from each of the layers at ``deepstack_visual_indexes`` (the language model adds those to its
first layers' hidden states at the image's tokens).

    patches ─ patch_embed (Conv3d with bias) + learned positions, bilinearly resampled from a
              side x side table to the image's h x w (align_corners) ─ blocks:
              x + attn(norm1(x)); x + mlp(norm2(x))   (LayerNorm, GELU MLP, 2-D rotary,
              bidirectional over each frame) ─ merger (LayerNorm, concat 2x2, MLP)
    after block i in deepstack_visual_indexes: deepstack merger (concat 2x2, LayerNorm, MLP)

Patches arrive grouped by merge square (HF's processor writes them so). Parameter names are
HF's (``visual.*``). Replicated on every tensor-parallel rank, like Qwen2.5-VL's tower.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.clip import vision_activation
from engine.models.qwen2_5_vision import (
    PatchEmbed,
    VisionBlock,
    merge_square_positions,
    rotary_cos_sin,
    rotary_inv_freq,
)


class VisionMLP(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(vision["hidden_size"], vision["intermediate_size"])
        self.linear_fc2 = nn.Linear(vision["intermediate_size"], vision["hidden_size"])
        self.act = vision_activation(vision["hidden_act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """``postshuffle``: the norm after concatenating each 2x2 square (deepstack's), else
    before (the main merger's)."""

    def __init__(self, vision: dict[str, Any], postshuffle: bool) -> None:
        super().__init__()
        dim = vision["hidden_size"]
        self.merged = dim * vision["spatial_merge_size"] ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged if postshuffle else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, vision["out_hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged) if self.postshuffle else x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionModel(nn.Module):
    """HF's ``Qwen3VLVisionModel`` for one image at a time."""

    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        self.merge = vision["spatial_merge_size"]
        self.side = int(vision["num_position_embeddings"] ** 0.5)
        self.patch_embed = PatchEmbed(vision, bias=True)
        self.pos_embed = nn.Embedding(vision["num_position_embeddings"], vision["hidden_size"])
        norm = functools.partial(nn.LayerNorm, eps=1e-6)
        self.blocks = nn.ModuleList(
            VisionBlock(vision, norm=norm, mlp=VisionMLP) for _ in range(vision["depth"])
        )
        self.merger = PatchMerger(vision, postshuffle=False)
        self.deepstack_visual_indexes = list(vision["deepstack_visual_indexes"])
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(vision, postshuffle=True) for _ in self.deepstack_visual_indexes
        )
        self.inv_freq = rotary_inv_freq(vision)

    def forward(self, patches: torch.Tensor, grid_thw: tuple[int, ...]) -> torch.Tensor:
        """``[t*h*w, C*T*P*P]`` -> ``[t*h*w / merge**2, out_hidden * (1 + deepstack layers)]``:
        the merged embeddings, then each deepstack layer's, side by side."""
        t, h, w = grid_thw
        rows, cols = merge_square_positions(t, h, w, self.merge)
        rows, cols = rows.to(patches.device), cols.to(patches.device)
        x = self.patch_embed(patches)
        indices, weights = self._interpolation(rows, cols, h, w)
        pos = (self.pos_embed(indices) * weights[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = rotary_cos_sin(rows, cols, self.inv_freq.to(x.device))
        frames = [i * h * w for i in range(t + 1)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, frames, cos, sin)
            if i in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)

    def _interpolation(
        self, rows: torch.Tensor, cols: torch.Tensor, h: int, w: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bilinear (align_corners) taps into the side x side table, and their weights, as
        HF's ``get_vision_interpolation_indices_and_weights`` computes them in float32."""
        side = self.side

        def axis(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
            src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
            floor = torch.floor(src)
            offsets = torch.arange(0, 2, device=index.device)
            taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
            weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
            return taps, weights

        h_taps, h_weights = axis(rows, h)
        w_taps, w_weights = axis(cols, w)
        indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        return indices, weights
