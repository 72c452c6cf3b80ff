"""Mixture-of-experts experts, tensor-parallel: every rank holds a slice of every expert's
intermediate dimension, so the expert compute is an MLP sharded like ``GatedMLP`` — gate/up
split by output rows, down by input columns — and the caller all-reduces the partial sums once.

    gate_up_proj  [E, 2 * I/tp, H]   rank r: [gate rows r*I/tp ... ; up rows r*I/tp ...]
    down_proj     [E, H, I/tp]       rank r: columns r*I/tp ...

A checkpoint stores the experts either one tensor per expert and projection (HF's
``experts.N.gate_proj.weight`` ..., what ``save_pretrained`` writes; ``shard_id`` =
``(N, 0 | 1)`` for gate / up, ``N`` for down) or already stacked (``experts.gate_up_proj``
``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``, ``shard_id=None``); either way a rank
reads only its rows / columns.

Compute (:func:`grouped_experts`): the ``T x K`` (token, expert) pairs are sorted by expert, and
each expert that received tokens runs one GEMM over its contiguous run of rows; experts with no
tokens cost nothing. The routing weights multiply each pair's output in their own dtype, then
the K outputs of a token are summed in top-k order and cast to the activations' dtype, as HF's
``grouped_mm`` experts do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parallel.layers import check_shape, divide
from parallel.state import SINGLE, GroupCoordinator

ActAndMul = Callable[[torch.Tensor], torch.Tensor]


def grouped_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    act_and_mul: ActAndMul,
) -> torch.Tensor:
    """``sum_k w[t, k] * down_e(act_and_mul(gate_up_e(x[t])))`` with ``e = topk_ids[t, k]``.

    ``x`` ``[T, H]``; ``gate_up_proj`` ``[E, 2I, H]``; ``down_proj`` ``[E, H, I]``;
    ``topk_ids`` / ``topk_weights`` ``[T, K]``. Returns ``[T, H]`` in ``x``'s dtype.
    """
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[-1]
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    num_experts = gate_up_proj.shape[0]
    flat_ids = topk_ids.reshape(-1)
    # Stable, so the pairs of one expert keep token order (deterministic row order per GEMM).
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts)
    # One host sync for the whole layer: each active expert's run [end - count, end).
    ends = torch.cumsum(counts, 0).tolist()
    sizes = counts.tolist()
    rows = x[order // top_k]
    sorted_out = x.new_empty(num_tokens * top_k, hidden)
    for expert in (e for e, n in enumerate(sizes) if n):
        end = ends[expert]
        start = end - sizes[expert]
        inter = act_and_mul(F.linear(rows[start:end], gate_up_proj[expert]))
        sorted_out[start:end] = F.linear(inter, down_proj[expert])
    pair_out = torch.empty_like(sorted_out)
    pair_out[order] = sorted_out
    weighted = pair_out.view(num_tokens, top_k, hidden) * topk_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(x.dtype)


class ParallelExperts(nn.Module):
    """The stacked gated-MLP experts of one MoE layer, sharded over the TP group on the
    intermediate dimension. ``forward`` returns this rank's partial sum (not all-reduced)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        act_and_mul: ActAndMul,
        *,
        tp: GroupCoordinator = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.inter_per_rank = divide(intermediate_size, tp.size, "moe intermediate size")
        self.act_and_mul = act_and_mul
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * self.inter_per_rank, hidden_size), requires_grad=False
        )
        self.gate_up_proj.weight_loader = self.gate_up_loader
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.inter_per_rank), requires_grad=False
        )
        self.down_proj.weight_loader = self.down_loader

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return grouped_experts(
            x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, self.act_and_mul
        )

    def _expert(self, shard_id: Any, what: str) -> int:
        if isinstance(shard_id, bool) or not isinstance(shard_id, int):
            raise ValueError(f"shard_id: {what} needs an expert index, got {shard_id!r}")
        if not 0 <= shard_id < self.num_experts:
            raise ValueError(
                f"expert index {shard_id} out of range: num_experts is {self.num_experts}"
            )
        return shard_id

    def gate_up_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """A stacked ``[E, 2I, H]`` tensor (``shard_id=None``) or one expert's gate (part 0)
        or up (part 1) projection ``[I, H]`` (``shard_id=(expert, part)``)."""
        inter, size, rank = self.intermediate_size, self.inter_per_rank, self.tp.rank
        if shard_id is None:
            check_shape(
                loaded, (self.num_experts, 2 * inter, self.hidden_size), "stacked expert gate_up"
            )
            for part in (0, 1):
                start = part * inter + rank * size
                param.data[:, part * size : (part + 1) * size].copy_(
                    loaded[:, start : start + size]
                )
            return
        if not isinstance(shard_id, tuple) or len(shard_id) != 2 or shard_id[1] not in (0, 1):
            raise ValueError(f"shard_id: must be (expert, 0 | 1) for gate / up, got {shard_id!r}")
        expert = self._expert(shard_id[0], "gate_up_proj")
        part = shard_id[1]
        check_shape(loaded, (inter, self.hidden_size), f"expert {expert} part {part}")
        rows = loaded[rank * size : (rank + 1) * size]
        param.data[expert, part * size : (part + 1) * size].copy_(rows)

    def down_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """A stacked ``[E, H, I]`` tensor (``shard_id=None``) or one expert's ``[H, I]``
        (``shard_id=expert``)."""
        inter, size, rank = self.intermediate_size, self.inter_per_rank, self.tp.rank
        if shard_id is None:
            check_shape(
                loaded, (self.num_experts, self.hidden_size, inter), "stacked expert down_proj"
            )
            param.data.copy_(loaded[:, :, rank * size : (rank + 1) * size])
            return
        expert = self._expert(shard_id, "down_proj")
        check_shape(loaded, (self.hidden_size, inter), f"expert {expert} down_proj")
        param.data[expert].copy_(loaded[:, rank * size : (rank + 1) * size])

    def expected_parts(self, param_name: str) -> frozenset[Any]:
        """The per-expert shard ids that fill parameter ``param_name`` (``gate_up_proj`` or
        ``down_proj``) when the checkpoint stores one tensor per expert."""
        experts = range(self.num_experts)
        if param_name == "gate_up_proj":
            return frozenset((e, p) for e in experts for p in (0, 1))
        return frozenset(experts)
