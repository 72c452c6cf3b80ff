"""torch.distributed set-up for one worker: rendezvous, process groups, stage-to-stage transfer.

Rank layout (world = TP x PP). TP groups are consecutive ranks inside a pipeline stage, so
the all-reduce of every layer stays among neighbours (one node, NVLink); PP groups link the
same TP rank across stages:

    TP = 2, PP = 2        stage 0        stage 1
    TP groups             [0, 1]         [2, 3]
    PP groups             [0, 2], [1, 3]

With data-parallel attention (``dp_size`` > 1, no PP) the world is DP x TP, DP-major: DP rank d
holds ranks ``[d*TP, (d+1)*TP)`` as its TP group, and one EP group spans every rank, over which
MoE layers exchange their tokens (``parallel.moe``):

    DP = 2, TP = 2        TP groups [0, 1], [2, 3]        EP group [0, 1, 2, 3]

Rendezvous goes through a ``TCPStore`` that rank 0 hosts on an OS-assigned port of a known
address (the socket is bound before the store takes it over, so it never listens on every
interface). Every group carries a bounded timeout, so a dead peer fails a collective instead
of hanging it forever.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel.state import SINGLE, GroupCoordinator, ParallelContext

DEFAULT_TIMEOUT_S = 120.0


@dataclass
class RendezvousStore:
    """The master ``TCPStore`` and the listening socket it serves on (kept alive with it)."""

    store: dist.TCPStore
    host: str
    port: int
    _sock: socket.socket = field(repr=False)

    def close(self) -> None:
        self._sock.close()


def create_store(
    host: str, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
) -> RendezvousStore:
    """Host the rendezvous store on ``host`` at a port the OS picks."""
    _check_world_size(world_size)
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen()
        port = sock.getsockname()[1]
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    return RendezvousStore(store=store, host=host, port=port, _sock=sock)


def connect_store(
    host: str, port: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dist.TCPStore:
    _check_world_size(world_size)
    if not 0 < port < 65536:
        raise ValueError(f"port: must be in (0, 65536), got {port}")
    return dist.TCPStore(
        host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
    )


def tp_group_ranks(tp_size: int, pp_size: int, dp_size: int = 1) -> list[list[int]]:
    return [
        [(dp * pp_size + stage) * tp_size + i for i in range(tp_size)]
        for dp in range(dp_size)
        for stage in range(pp_size)
    ]


def pp_group_ranks(tp_size: int, pp_size: int) -> list[list[int]]:
    return [[stage * tp_size + i for stage in range(pp_size)] for i in range(tp_size)]


def coordinates(rank: int, tp_size: int, pp_size: int, dp_size: int = 1) -> tuple[int, int, int]:
    """(tp_rank, pp_rank, dp_rank) of a global rank."""
    world = tp_size * pp_size * dp_size
    if not 0 <= rank < world:
        raise ValueError(f"rank: must be in [0, {world}), got {rank}")
    return rank % tp_size, rank // tp_size % pp_size, rank // (tp_size * pp_size)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(
    store: dist.Store,
    rank: int,
    tp_size: int,
    pp_size: int,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    dp_size: int = 1,
) -> ParallelContext:
    """Join the world process group and build this rank's TP and PP groups, and with
    ``dp_size`` > 1 the EP group over every rank (experts then split over all DP x TP ranks).

    Every rank must call this (``new_group`` is collective over the whole world, in the same
    order everywhere, even for groups the caller is not in)."""
    if dp_size > 1 and pp_size > 1:
        raise ValueError(
            f"dp_size: data parallelism ({dp_size}) does not combine with pipeline parallelism "
            f"({pp_size} stages)"
        )
    world = tp_size * pp_size * dp_size
    tp_rank, pp_rank, _ = coordinates(rank, tp_size, pp_size, dp_size)
    if world == 1:
        return ParallelContext()  # every collective is the identity: no process group needed
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend_for(device), store=store, rank=rank, world_size=world, timeout=timeout
        )
    tp = _build_groups(tp_group_ranks(tp_size, pp_size, dp_size), rank, timeout)
    pp = _build_groups(pp_group_ranks(tp_size, pp_size), rank, timeout)
    if tp.rank != tp_rank or pp.rank != pp_rank:
        raise RuntimeError(f"rank {rank}: group layout disagrees with (tp {tp_rank}, pp {pp_rank})")
    if dp_size == 1:
        return ParallelContext(tp=tp, pp=pp)
    ep = _build_groups([list(range(world))], rank, timeout)
    return ParallelContext(tp=tp, pp=pp, ep=ep)


def _build_groups(layout: list[list[int]], rank: int, timeout: timedelta) -> GroupCoordinator:
    mine = SINGLE
    for ranks in layout:
        # Size-1 groups need no communicator; every rank skips the same ones, so the
        # collective new_group calls still line up.
        group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
        if rank in ranks:
            mine = GroupCoordinator(
                rank=ranks.index(rank), size=len(ranks), group=group, ranks=tuple(ranks)
            )
    return mine


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def send_intermediate(pp: GroupCoordinator, hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """Send (hidden, residual) [num_tokens, hidden_size] each to the next stage, as one message."""
    if pp.is_last:
        raise RuntimeError("the last pipeline stage has no next stage to send to")
    pp.send(torch.stack((hidden, residual)), dst=pp.rank + 1)


def recv_intermediate(
    pp: GroupCoordinator,
    num_tokens: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Receive the previous stage's (hidden, residual); the shape is known from the step."""
    if pp.is_first:
        raise RuntimeError("the first pipeline stage has no previous stage to receive from")
    buf = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
    pp.recv(buf, src=pp.rank - 1)
    return buf[0], buf[1]


def _check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: must be a positive integer, got {world_size!r}")
