"""What every mixture-of-experts kernel takes, shared by the torch path (``llm_kernels.moe``)
and the Triton kernels (``llm_kernels.triton_moe``, ``llm_kernels.triton_mxfp4_moe``): the
argument checks, the map from global to this rank's expert ids under expert parallelism, and
experts kept in MXFP4 (:class:`Mxfp4Experts`). It imports neither side, so the kernels import it
and not each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llm_kernels.mxfp4 import VALUES_PER_SCALE, check_mxfp4, dequantize_mxfp4

__all__ = ["MOE_DTYPES", "Mxfp4Experts", "check_moe_args", "check_moe_inputs", "local_expert_ids"]

MOE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Mxfp4Experts:
    """One rank's experts in MXFP4 (``llm_kernels.mxfp4``), in the checkpoint's layout::

        w13_blocks [E, 2I, H/32, 16]  w13_scales [E, 2I, H/32]   row 2j: gate j, 2j + 1: up j
        w13_bias   [E, 2I]            interleaved alike (None: no bias)
        w2_blocks  [E, H, G, 16]      w2_scales  [E, H, G]       input i at position
                                                                  w2_offset + i of a row
        w2_bias    [E, H]             (None: no bias)

    Under TP a rank holds a run of 2I / tp interleaved rows of w13 and, of w2, the groups that
    cover its I / tp inputs; ``w2_offset`` (< 32) is where they start in the first group."""

    w13_blocks: Tensor
    w13_scales: Tensor
    w13_bias: Tensor | None
    w2_blocks: Tensor
    w2_scales: Tensor
    w2_bias: Tensor | None
    w2_offset: int = 0

    @property
    def num_experts(self) -> int:
        return self.w13_blocks.shape[0]

    @property
    def intermediate(self) -> int:
        return self.w13_blocks.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.w2_blocks.shape[1]

    def check(self, x: Tensor) -> None:
        """Shapes, dtypes and devices against ``x [T, H]``; ValueError names the tensor."""
        check_mxfp4(self.w13_blocks, self.w13_scales, "w13")
        check_mxfp4(self.w2_blocks, self.w2_scales, "w2")
        e, two_i, groups, _ = self.w13_blocks.shape
        hidden = x.shape[1]
        if two_i % 2 or groups * VALUES_PER_SCALE != hidden:
            raise ValueError(
                f"w13_blocks must be [experts, 2 * intermediate, {hidden // VALUES_PER_SCALE}, 16] "
                f"for x's hidden size {hidden}, got {list(self.w13_blocks.shape)}"
            )
        covered = self.w2_offset + self.intermediate
        need = -(-covered // VALUES_PER_SCALE)
        if not 0 <= self.w2_offset < VALUES_PER_SCALE:
            raise ValueError(f"w2_offset must be in [0, 32), got {self.w2_offset}")
        if tuple(self.w2_blocks.shape[:3]) != (e, hidden, need):
            raise ValueError(
                f"w2_blocks must be [{e}, {hidden}, {need}, 16] to hold inputs "
                f"[{self.w2_offset}, {covered}) of its rows, got {list(self.w2_blocks.shape)}"
            )
        for name, bias, shape in (
            ("w13_bias", self.w13_bias, (e, two_i)),
            ("w2_bias", self.w2_bias, (e, hidden)),
        ):
            if bias is not None and tuple(bias.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)}, got {list(bias.shape)}")
        for name, t in vars(self).items():
            if isinstance(t, Tensor) and t.device != x.device:
                raise ValueError(f"{name} is on {t.device}, x on {x.device}")

    def dense(self, expert: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Expert ``expert``'s (w13 [2I, H], w2 [H, I]) dequantized into ``dtype``."""
        w13 = dequantize_mxfp4(self.w13_blocks[expert], self.w13_scales[expert], dtype)
        w2 = dequantize_mxfp4(self.w2_blocks[expert], self.w2_scales[expert], dtype)
        return w13, w2[:, self.w2_offset : self.w2_offset + self.intermediate]


def local_expert_ids(topk_ids: Tensor, expert_map: Tensor | None, num_experts: int) -> Tensor:
    """``topk_ids`` as indices into this rank's ``num_experts`` stacked experts (-1: elsewhere)."""
    if expert_map is None:
        return topk_ids
    if expert_map.dim() != 1 or expert_map.dtype.is_floating_point:
        raise ValueError(
            f"expert_map must be a 1-D integer tensor, got {expert_map.dtype} "
            f"{list(expert_map.shape)}"
        )
    if expert_map.device != topk_ids.device:
        raise ValueError(f"expert_map is on {expert_map.device}, topk_ids on {topk_ids.device}")
    return expert_map[topk_ids.long()].to(topk_ids.dtype)


def check_moe_args(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor
) -> None:
    """Shapes and dtypes of ``fused_moe``'s arguments; ValueError names the first bad one."""
    check_moe_inputs(x, topk_weights, topk_ids)
    hidden = x.shape[1]
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(
            f"w13 must be [experts, 2 * intermediate, {hidden}], got {list(w13.shape)}"
        )
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    if w2.shape != (num_experts, hidden, intermediate):
        raise ValueError(
            f"w2 must be [{num_experts}, {hidden}, {intermediate}] to match w13, "
            f"got {list(w2.shape)}"
        )
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"{name} must have x's dtype {x.dtype} and device {x.device}")


def check_moe_inputs(x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> None:
    """``x`` and the routing of any fused-MoE entry point; ValueError names the first bad one."""
    if x.dim() != 2 or x.dtype not in MOE_DTYPES:
        raise ValueError(
            f"x must be [tokens, hidden] float32/bfloat16/float16, got {x.dtype} {list(x.shape)}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [{x.shape[0]}, top_k], got {list(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        raise ValueError(
            f"topk_weights must be a float tensor shaped like topk_ids {list(topk_ids.shape)}, "
            f"got {topk_weights.dtype} {list(topk_weights.shape)}"
        )
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
