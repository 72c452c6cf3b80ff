"""Batched multi-LoRA deltas in plain torch: the CPU path and the reference for
``llm_kernels.triton_lora``.

Every token of a packed batch adds the low-rank update of the adapter in its slot, or nothing
(slot -1), so one step mixes requests of several adapters and of the base model:

    x [T, in] ─ shrink: v_t = A[slot_t] x_t ─▶ v [T, R] ─ expand: y_t += B[slot_t] v_t ─▶ y [T, out]

    A [num_slots, R, in]    B [num_slots, out, R]    R = the padded rank (unused rows of A and
    columns of B are zero); the adapter's scaling (alpha / r) is folded into B at load time.

The torch path groups tokens by slot (``LoRAMapping.groups``, computed once per step for all
layers) and runs two dense matmuls per adapter present, so its cost grows with the adapters in
the step, not with the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

__all__ = ["LoRAMapping", "add_lora", "lora_expand", "lora_shrink"]


@dataclass
class LoRAMapping:
    """Which adapter slot each token of this step uses (-1: none).

    ``groups``: (slot, rows) per slot present; ``rows`` is None when every token uses that slot
    (no gather needed).
    """

    token_slots: Tensor  # [T] int32, on the model's device
    groups: list[tuple[int, Tensor | None]] = field(default_factory=list)

    @classmethod
    def build(cls, token_slots: np.ndarray, device: torch.device) -> LoRAMapping:
        slots = np.asarray(token_slots, dtype=np.int32)
        groups: list[tuple[int, Tensor | None]] = []
        for slot in np.unique(slots):
            if slot < 0:
                continue
            rows = np.flatnonzero(slots == slot)
            index = None if len(rows) == len(slots) else torch.from_numpy(rows).to(device)
            groups.append((int(slot), index))
        return cls(torch.from_numpy(slots).to(device), groups)

    @classmethod
    def empty(cls, device: torch.device) -> LoRAMapping:
        return cls(torch.empty(0, dtype=torch.int32, device=device))

    @property
    def has_lora(self) -> bool:
        return bool(self.groups)


def lora_shrink(x: Tensor, lora_a: Tensor, mapping: LoRAMapping) -> Tensor:
    """v [T, R] with v_t = A[slot_t] x_t (zero rows for slot -1)."""
    v = x.new_zeros(x.shape[0], lora_a.shape[1])
    for slot, rows in mapping.groups:
        if rows is None:
            v.copy_(x @ lora_a[slot].T)
        else:
            v.index_copy_(0, rows, x.index_select(0, rows) @ lora_a[slot].T)
    return v


def lora_expand(y: Tensor, v: Tensor, lora_b: Tensor, mapping: LoRAMapping) -> None:
    """In place: y_t += B[slot_t] v_t for tokens with an adapter."""
    for slot, rows in mapping.groups:
        if rows is None:
            y.add_(v @ lora_b[slot].T)
        else:
            y.index_add_(0, rows, v.index_select(0, rows) @ lora_b[slot].T)


def add_lora(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, mapping: LoRAMapping) -> None:
    """In place: y_t += B[slot_t] (A[slot_t] x_t), one shrink and one expand per slot present."""
    for slot, rows in mapping.groups:
        if rows is None:
            y.add_((x @ lora_a[slot].T) @ lora_b[slot].T)
        else:
            delta = (x.index_select(0, rows) @ lora_a[slot].T) @ lora_b[slot].T
            y.index_add_(0, rows, delta)
