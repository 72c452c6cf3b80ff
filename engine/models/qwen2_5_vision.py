"""Qwen2.5-VL's vision transformer: an image's flattened patches and its (t, h, w) patch grid
-> one embedding per merged 2x2 square of patches, in the order the language model's image
tokens take them.

    patches [t*h*w, C*T*P*P] ─ patch_embed (Conv3d, stride = kernel) ─ reorder into windows
        ─ blocks: x + attn(norm1(x)); x + mlp(norm2(x))      (RMSNorm, SiLU-gated MLP)
              attention: bidirectional, 2-D rotary (rows | columns) on q and k, within each
              window of window_size pixels, over the whole frame at fullatt_block_indexes
        ─ merger: ln_q ─ concat each 2x2 square ─ Linear ─ GELU ─ Linear ─ original order

Patches arrive grouped by merge square (HF's processor writes them so): a "window" is a
square of window_size / (patch * merge) merged units, cut from the top-left, ragged at the
edges, exactly as HF's ``get_vision_window_index``. Parameter names are HF's (``visual.*``).
The tower is small next to the language model and runs once per image, so it is replicated on
every tensor-parallel rank (plain ``nn.Linear``s, no collectives).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, vision: dict[str, Any], bias: bool = False) -> None:
        super().__init__()
        self.channels = vision["in_channels"]
        self.kernel = (vision["temporal_patch_size"], vision["patch_size"], vision["patch_size"])
        self.dim = vision["hidden_size"]
        self.proj = nn.Conv3d(
            self.channels, self.dim, kernel_size=self.kernel, stride=self.kernel, bias=bias
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = patches.view(-1, self.channels, *self.kernel).to(self.proj.weight.dtype)
        return self.proj(x).view(-1, self.dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        dim = vision["hidden_size"]
        self.num_heads = vision["num_heads"]
        self.head_dim = dim // self.num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        # Rotated in float32 and cast back, as HF does.
        cos, sin = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = torch.empty_like(q)
        for lo, hi in itertools.pairwise(cu_seqlens):
            qs, ks, vs = (t[lo:hi].transpose(0, 1)[None] for t in (q, k, v))
            attn = F.scaled_dot_product_attention(qs, ks, vs, scale=self.head_dim**-0.5)
            out[lo:hi] = attn[0].transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        dim, inter = vision["hidden_size"], vision["intermediate_size"]
        self.gate_proj = nn.Linear(dim, inter)
        self.up_proj = nn.Linear(dim, inter)
        self.down_proj = nn.Linear(inter, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """``x + attn(norm1(x)); x + mlp(norm2(x))``: ``norm`` makes a norm of a width (Qwen2.5-VL's
    RMSNorm, Qwen3-VL's LayerNorm), ``mlp`` the MLP of the tower's config."""

    def __init__(
        self,
        vision: dict[str, Any],
        norm: Callable[[int], nn.Module] = VisionRMSNorm,
        mlp: Callable[[dict[str, Any]], nn.Module] = VisionMLP,
    ) -> None:
        super().__init__()
        self.norm1 = norm(vision["hidden_size"])
        self.norm2 = norm(vision["hidden_size"])
        self.attn = VisionAttention(vision)
        self.mlp = mlp(vision)

    def forward(
        self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        dim = vision["hidden_size"]
        self.merged = dim * vision["spatial_merge_size"] ** 2
        self.ln_q = VisionRMSNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged, self.merged),
            nn.GELU(),
            nn.Linear(self.merged, vision["out_hidden_size"]),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


def rotary_inv_freq(vision: dict[str, Any]) -> torch.Tensor:
    """HF's float32 inverse frequencies of the tower's 2-D rotary (a quarter of a head each for
    rows and columns); a plain tensor (moved per image; not a buffer)."""
    head_dim = vision["hidden_size"] // vision["num_heads"]
    theta = float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    spatial = head_dim // 2
    exponents = torch.arange(0, spatial, 2, dtype=torch.float32, device="cpu") / spatial
    return 1.0 / (theta**exponents)


def merge_square_positions(t: int, h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) in the order the processor writes patches: grouped by merge
    square (block row, block column, row in square, column in square), frame after frame."""
    m = merge
    rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
    cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
    rows = rows.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    cols = cols.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    return rows, cols


def rotary_cos_sin(
    rows: torch.Tensor, cols: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin per patch: the row's angles then the column's, twice (rotate-half layout)."""
    freqs = torch.stack([rows, cols], dim=-1)[..., None].float() * inv_freq  # [S, 2, hd / 4]
    angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    return (
        torch.cat([angles.cos(), angles.cos()], dim=-1),
        torch.cat([angles.sin(), angles.sin()], dim=-1),
    )


class Qwen2_5_VisionTransformer(nn.Module):
    """HF's ``Qwen2_5_VisionTransformerPretrainedModel`` for one image at a time."""

    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        self.merge = vision["spatial_merge_size"]
        self.window = vision["window_size"] // self.merge // vision["patch_size"]
        self.full_attention = set(vision["fullatt_block_indexes"])
        self.patch_embed = PatchEmbed(vision)
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision["depth"]))
        self.merger = PatchMerger(vision)
        self.inv_freq = rotary_inv_freq(vision)

    def forward(self, patches: torch.Tensor, grid_thw: tuple[int, ...]) -> torch.Tensor:
        """``[t*h*w, C*T*P*P]`` -> ``[t*h*w / merge**2, out_hidden_size]``."""
        t, h, w = grid_thw
        unit = self.merge**2
        order, windows = self._window_order(t, h, w)
        order = order.to(patches.device)
        x = self.patch_embed(patches)
        x = x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)
        cos, sin = self._rotary(t, h, w, order)
        frame = h * w
        full = [i * frame for i in range(t + 1)]
        for i, block in enumerate(self.blocks):
            x = block(x, full if i in self.full_attention else windows, cos, sin)
        merged = self.merger(x)
        return merged[torch.argsort(order)]

    def _rotary(
        self, t: int, h: int, w: int, order: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin per patch, window order: the row's angles then the column's, twice."""
        rows, cols = merge_square_positions(t, h, w, self.merge)
        device = order.device
        cos, sin = rotary_cos_sin(rows.to(device), cols.to(device), self.inv_freq.to(device))
        unit = self.merge**2

        def reorder(table: torch.Tensor) -> torch.Tensor:
            return table.view(-1, unit, table.shape[-1])[order].reshape(table.shape)

        return reorder(cos), reorder(sin)

    def _window_order(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """The merged units in window order, and the windows' cumulative patch counts."""
        gh, gw, size = h // self.merge, w // self.merge, self.window
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        pad_h, pad_w = size - gh % size, size - gw % size
        nh, nw = (gh + pad_h) // size, (gw + pad_w) // size
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        padded = padded.view(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, -1)
        counts = (padded >= 0).sum(-1).reshape(-1)
        order = padded.reshape(-1)
        order = order[order >= 0]
        unit = self.merge**2
        bounds = [0]
        for count in counts.tolist():
            if count:
                bounds.append(bounds[-1] + count * unit)
        return order, bounds
