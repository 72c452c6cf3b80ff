"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): the window-attention vision tower of
``engine.models.qwen2_5_vision`` and a Qwen2 language model whose rotary is M-RoPE, from a
flattened config (``engine.qwen_vl_config``).

    image patches + grid ─ visual (replicated on every TP rank) ─▶ one embedding per image token
    prompt ─ embed_tokens, image tokens' rows replaced ─ Qwen2 decoder (M-RoPE) ─ LM head

M-RoPE: each token has a (t, h, w) position (``engine.multimodal.mrope``; the model runner
passes them ``[3, num_tokens]``). The rotary's frequency pairs are split by ``mrope_section``
(e.g. [16, 24, 24] of 64 pairs): pair i rotates by the t, h or w position of its section. The
cos / sin rows are gathered per token from the model's one table and handed to the kernel's
rotary as a per-token table (positions 0 .. n-1), so the torch and Triton paths rotate the
same, exactly. 1-D positions (a text-only warm-up) rotate as plain rope.

Checkpoint names: transformers 5's save (``model.language_model.*``, ``model.visual.*``,
``lm_head.*``) and the hub's (``model.*``, ``visual.*``, ``lm_head.*``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from engine.models.llama import Qwen2ForCausalLM
from engine.models.qwen2_5_vision import Qwen2_5_VisionTransformer
from engine.models.rotary import RotaryEmbedding
from engine.models.vlm_checkpoint import VLMCheckpointNames
from llm_kernels.backend import KernelOps
from parallel.state import ParallelContext

_RENAMES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
)


def mrope_axes(rotary_dim: int, section: list[int], interleaved: bool = False) -> torch.Tensor:
    """For each of the ``rotary_dim`` cos/sin columns, the position axis (0 t, 1 h, 2 w) that
    rotates it, both halves alike: the pairs split into ``section``'s runs (Qwen2.5-VL), or
    ``interleaved`` (Qwen3-VL: t h w t h w ..., pair 3i + 1 is h for i < section[1], 3i + 2 is
    w for i < section[2], every other pair t)."""
    if sum(section) != rotary_dim // 2:
        raise ValueError(f"mrope_section: {section} must sum to {rotary_dim // 2}")
    if interleaved:
        half = torch.zeros(rotary_dim // 2, dtype=torch.int64)
        half[1 : 3 * section[1] : 3] = 1
        half[2 : 3 * section[2] : 3] = 2
    else:
        half = torch.cat([torch.full((n,), a, dtype=torch.int64) for a, n in enumerate(section)])
    return torch.cat([half, half])


class MRotaryEmbedding(nn.Module):
    """M-RoPE over a plain ``RotaryEmbedding``'s table (see the module docstring)."""

    def __init__(self, base: RotaryEmbedding, section: list[int], interleaved: bool) -> None:
        super().__init__()
        self.base = base
        # Not a buffer (16 bytes a model; memory plans count rotary tables only): moved to a
        # device once, at its first use there.
        self._axes = {"cpu": mrope_axes(base.rotary_dim, section, interleaved)}

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return self.base(positions, q, k)
        n, dim = positions.shape[1], self.base.rotary_dim
        key = str(positions.device)
        if key not in self._axes:
            self._axes[key] = self._axes["cpu"].to(positions.device)
        axes = self._axes[key].view(1, 1, dim).expand(1, n, dim)
        cos = self.base.cos[positions].gather(0, axes)[0]
        sin = self.base.sin[positions].gather(0, axes)[0]
        rows = torch.arange(n, device=positions.device)
        ops = self.base.ops
        if dim == self.base.head_dim:
            return ops.rotary_embedding(rows, q, k, cos, sin)
        q_rot, k_rot = ops.rotary_embedding(rows, q[..., :dim], k[..., :dim], cos, sin)
        return torch.cat((q_rot, q[..., dim:]), -1), torch.cat((k_rot, k[..., dim:]), -1)


class QwenVLMixin(VLMCheckpointNames):
    """What Qwen2.5-VL and Qwen3-VL add to their decoder family (a ``CausalLM``): M-RoPE, the
    tower (``self.visual``, set by the subclass), image embeddings and checkpoint names."""

    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = _RENAMES
    vision_prefixes: ClassVar[tuple[str, ...]] = ("visual.",)
    uses_mrope = True
    hf: dict[str, Any]
    model: nn.Module
    visual: nn.Module

    def rotary(self, layer: int) -> MRotaryEmbedding:
        """One M-RoPE module shared by every layer (built at the first layer's call)."""
        existing = self._modules.get("mrotary")  # type: ignore[attr-defined]
        if existing is None:
            base = super().rotary(layer)  # type: ignore[misc]
            section = list(self.hf["mrope_section"])
            existing = MRotaryEmbedding(base, section, bool(self.hf.get("mrope_interleaved")))
            self.mrotary = existing
        return existing

    def embed_multimodal(
        self, pixel_values: torch.Tensor, grid_thw: tuple[int, ...]
    ) -> torch.Tensor:
        """``[num_images, patches, C*T*P*P]`` of one grid -> ``[num_images, tokens, width]``."""
        return torch.stack([self.visual(p, grid_thw) for p in pixel_values])

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)


class Qwen2_5_VLForConditionalGeneration(QwenVLMixin, Qwen2ForCausalLM):
    """``Qwen2ForCausalLM`` with M-RoPE, plus ``visual``."""

    def __init__(
        self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps | None = None
    ) -> None:
        super().__init__(hf, ctx, ops)
        self.visual = Qwen2_5_VisionTransformer(hf["vision_config"])
