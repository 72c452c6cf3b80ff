"""Process-group handles passed explicitly to layers (no module-global parallel state).

A ``GroupCoordinator`` wraps one torch.distributed group (a TP group inside a pipeline stage,
the PP group across stages, or the EP group over data-parallel ranks). With size 1 every
collective is the identity and no torch.distributed state is needed, so TP = 1 runs the same
model code in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupCoordinator:
    rank: int = 0  # rank inside this group
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup when size > 1
    ranks: tuple[int, ...] = (0,)  # global ranks of the members, in group-rank order

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every member's ``x`` along ``dim`` on group rank 0; None elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=self.ranks[0], group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def all_to_all_counts(self, send_counts: list[int]) -> list[int]:
        """Each member's ``send_counts[i]`` goes to member ``i``; returns what every member
        sends this one, in member order (the row counts of a following ``all_to_all``)."""
        _check_counts(send_counts, self.size, "send_counts")
        if self.size == 1:
            return list(send_counts)
        received = torch.empty(self.size, dtype=torch.int64)
        dist.all_to_all_single(
            received, torch.tensor(send_counts, dtype=torch.int64), group=self.group
        )
        return received.tolist()

    def all_to_all(
        self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """Rows of ``x`` to the members in order (the first ``send_counts[0]`` to member 0,
        the next ``send_counts[1]`` to member 1, ...); returns the rows received, ``recv_counts[i]``
        from member ``i``, in member order. Counts may be uneven and zero; every member calls it."""
        _check_counts(send_counts, self.size, "send_counts")
        _check_counts(recv_counts, self.size, "recv_counts")
        if sum(send_counts) != x.shape[0]:
            raise ValueError(
                f"send_counts: must add up to the {x.shape[0]} rows of x, got {send_counts}"
            )
        if self.size == 1:
            return x
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point-to-point send to group rank ``dst`` (pipeline stage to stage)."""
        _check_peer(dst, self.size, "dst")
        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.group)

    def recv(self, out: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into ``out`` (whose shape and dtype the caller knows) from group rank ``src``."""
        _check_peer(src, self.size, "src")
        dist.recv(out, src=self.ranks[src], group=self.group)
        return out


def _check_counts(counts: list[int], size: int, name: str) -> None:
    if len(counts) != size or any(c < 0 for c in counts):
        raise ValueError(
            f"{name}: must be {size} non-negative row counts, one per member, got {counts}"
        )


def _check_peer(peer: int, size: int, name: str) -> None:
    if size == 1:
        raise RuntimeError("point-to-point send/recv needs a group of size > 1")
    if not 0 <= peer < size:
        raise ValueError(f"{name}: must be a group rank in [0, {size}), got {peer}")


SINGLE = GroupCoordinator()


@dataclass(frozen=True)
class ParallelContext:
    """The groups one worker belongs to: its TP group (inside its stage), the PP group and,
    with data-parallel attention, the EP group over the data-parallel ranks."""

    tp: GroupCoordinator = SINGLE
    pp: GroupCoordinator = SINGLE
    # Decoder layers per pipeline stage as configured; None: the model's balanced default
    # (engine.pp_partition, which gives the last stage fewer layers for its LM head).
    layer_partition: tuple[int, ...] | None = None
    # enable_expert_parallel: MoE layers place whole experts on the ranks of the EP group
    # instead of slicing every expert over the TP group (parallel.moe).
    expert_parallel: bool = False
    # The EP group when it spans more than the TP group: every rank of every data-parallel
    # rank (DP x TP, DP-major), whose members hold different tokens, so MoE layers exchange
    # them (all-to-all). None: the EP group is the TP group, whose members hold the same tokens.
    ep: GroupCoordinator | None = None

    def warm_up(self, device: torch.device) -> None:
        """Run one small all-reduce in the TP group and one stage-to-stage transfer down the
        pipeline, so that the communicators exist (NCCL sets one up, buffers included, on its
        first operation) before memory is measured or a CUDA graph captures a collective.
        Collective: every rank of the world calls it at the same time."""
        if self.tp.size > 1:
            self.tp.all_reduce(torch.zeros(1, device=device))
        if self.pp.size > 1:
            # A chain, stage 0 -> 1 -> ... -> last: each stage receives before it sends, so no
            # cycle of blocking transfers can form.
            buf = torch.zeros(1, device=device)
            if not self.pp.is_first:
                self.pp.recv(buf, src=self.pp.rank - 1)
            if not self.pp.is_last:
                self.pp.send(buf, dst=self.pp.rank + 1)
