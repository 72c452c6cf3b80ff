"""LoRA adapters on the tensor-parallel linear layers: ``max_loras`` fixed slots of stacked,
zero-padded adapter weights per layer, and the per-step token -> slot mapping they share.

Sharding follows the base layer, so the delta needs no communication of its own:

    column-parallel (qkv, gate_up):  A [r, in] whole on every rank, B [out, r] split on out like W
                                     y_shard += B_shard (A x)
    row-parallel (o, down):          A [r, in] split on in like W, B [out, r] whole
                                     partial += B (A_shard x_shard), before W's all-reduce sums it

A fused layer (q|k|v, gate|up) stacks one rank block per slice: A's rows [i*R, i*R + r) hold
slice i's A, and B's columns [i*R, i*R + r) its B on that slice's output rows only (zero
elsewhere), so one shrink and one expand serve every slice. An adapter of the fused module
itself (Phi-3's checkpoint fuses them) has one A and a B over every slice: it takes the first
block, B on all output rows. R = max_lora_rank; the adapter's scaling is folded into B when it
is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from llm_kernels.lora import LoRAMapping
from parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

AddLoRA = Callable[[Tensor, Tensor, Tensor, Tensor, LoRAMapping], None]


class LoRABatch:
    """What every LoRA layer of one model reads each step: the token -> slot mapping (set by
    the model runner before the forward pass) and the kernel that adds the deltas."""

    def __init__(self, add_lora: AddLoRA, device: torch.device) -> None:
        self.add_lora = add_lora
        self.mapping = LoRAMapping.empty(device)


def lora_slices(layer: nn.Module) -> list[Any]:
    """The shard ids of a layer's fused parts (None for a plain layer), in output order."""
    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return [None]


class LinearLoRA:
    """The adapter weights of one linear layer: A [slots, S*R, in_local], B [slots, out_local,
    S*R] for S slices; ``active[slot]`` says whether the adapter in a slot touches this layer."""

    def __init__(self, layer: nn.Module, num_slots: int, max_rank: int, batch: LoRABatch) -> None:
        if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            raise TypeError(f"LoRA wraps the parallel linear layers, not {type(layer).__name__}")
        self.is_row = isinstance(layer, RowParallelLinear)
        self.slices = lora_slices(layer)
        self.max_rank = max_rank
        self.batch = batch
        # The weight's shard shape: A's input is split like W's on a row-parallel layer (and
        # whole otherwise), B's output like W's on a column-parallel one.
        out_local, in_local = layer.weight_shape
        width = len(self.slices) * max_rank
        dtype, device = layer.weight.dtype, layer.weight.device
        self.lora_a = torch.zeros(num_slots, width, in_local, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, out_local, width, dtype=dtype, device=device)
        self.active = [False] * num_slots
        self._weight_loader = layer.weight_loader

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.active[slot] = False

    def load_slice(
        self, slot: int, shard_id: Any, lora_a: Any, lora_b: Any, scaling: float
    ) -> None:
        """Load one slice's A [r, in] and B [out, r] (tensors or lazy safetensors slices) into
        ``slot``; each rank reads only its shard, like the base weight's loader. ``shard_id``
        None on a fused layer: B covers every slice's rows (the weight loader splits them)."""
        index = 0 if shard_id is None else self.slices.index(shard_id)
        rank = _shape(lora_a)[0]
        if rank > self.max_rank or _shape(lora_b)[1] != rank:
            raise ValueError(f"LoRA rank {rank} exceeds max_lora_rank {self.max_rank}")
        cols = slice(index * self.max_rank, index * self.max_rank + rank)
        a_view, b_view = self.lora_a[slot, cols, :], self.lora_b[slot, :, cols]
        if self.is_row:
            self._weight_loader(a_view, lora_a)
            b_view.copy_(lora_b[:])
        else:
            a_view.copy_(lora_a[:])
            if shard_id is None:
                self._weight_loader(b_view, lora_b)
            else:
                self._weight_loader(b_view, lora_b, shard_id)
        b_view.mul_(scaling)
        self.active[slot] = True

    def add_delta(self, x: Tensor, y: Tensor) -> None:
        """In place: y += this step's per-token deltas (a partial sum on row-parallel ranks)."""
        mapping = self.batch.mapping
        if not mapping.has_lora:
            return
        groups = [(slot, rows) for slot, rows in mapping.groups if self.active[slot]]
        if not groups:
            return
        if len(groups) != len(mapping.groups):
            mapping = LoRAMapping(mapping.token_slots, groups)
        self.batch.add_lora(y, x, self.lora_a, self.lora_b, mapping)


def _shape(loaded: Any) -> tuple[int, ...]:
    return tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)


def attach_lora(
    model: nn.Module, module_names: list[str], num_slots: int, max_rank: int, batch: LoRABatch
) -> dict[str, LinearLoRA]:
    """Give every linear layer whose name ends in one of ``module_names`` (e.g. ``qkv_proj``)
    a ``LinearLoRA``; returns them by module name."""
    attached = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in module_names and isinstance(
            module, (ColumnParallelLinear, RowParallelLinear)
        ):
            module.lora = LinearLoRA(module, num_slots, max_rank, batch)
            attached[name] = module.lora
    return attached
