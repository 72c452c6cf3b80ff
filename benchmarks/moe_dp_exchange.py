"""One MoE layer's experts on two CPU ranks (gloo), three placements of the same work, and where
the data-parallel exchange spends its time.

Both ranks together compute ``2 x --tokens`` tokens through one layer of ``--experts`` experts
(top ``--top-k``, SiLU gated MLP, oneDNN-packed weights as the engine loads them):

- ``tp2``: every expert sliced over TP = 2; both ranks hold all ``2T`` tokens (attention
  TP-sharded), each computes its slice of every pair, one all-reduce of ``[2T, H]``;
- ``ep2``: whole experts, half per rank (``enable_expert_parallel``, the EP group is the TP
  group); both ranks hold all ``2T`` tokens, each computes its experts' pairs, one all-reduce;
- ``dp2-ep2``: data-parallel attention, each rank holds its own ``T`` tokens; the pairs go to
  their experts' rank and back (``ParallelExperts._exchange``: one all-to-all of counts, then
  rows, expert ids and outputs), no all-reduce.

Per mode, the median milliseconds of a layer call on rank 0 over ``--calls`` calls (after
``--warmup``), and for ``dp2-ep2`` the median time inside the all-to-alls. Routing is random
(uniform logits), so both ranks receive about half the pairs.

    python -m benchmarks.moe_dp_exchange --tokens 32 --tokens 512 --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Any

from benchmarks.spawned import run_spawned

MODES = ("tp2", "ep2", "dp2-ep2")


def _rank_main(
    rank: int, ports: Any, results: Any, args: argparse.Namespace, tokens: int, port: int
) -> None:
    try:
        results.put((rank, _measure(rank, args, tokens, port)))
    except BaseException as exc:
        results.put((rank, repr(exc)))


def _measure(rank: int, args: argparse.Namespace, tokens: int, port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from llm_kernels.ops import silu_and_mul
    from parallel.moe import ParallelExperts
    from parallel.state import GroupCoordinator

    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    group = GroupCoordinator(rank=rank, size=2, group=dist.new_group([0, 1]), ranks=(0, 1))
    g = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    # Both ranks' tokens, the same on both ranks; under DP each rank keeps its own half.
    x = torch.randn(2 * tokens, h, generator=g)
    weights, ids = torch.topk(torch.randn(2 * tokens, e, generator=g).softmax(-1), args.top_k)
    out: dict[str, Any] = {}
    for mode in MODES:
        if mode == "tp2":
            experts = ParallelExperts(e, h, i, silu_and_mul, tp=group)
        elif mode == "ep2":
            experts = ParallelExperts(e, h, i, silu_and_mul, tp=group, expert_parallel=True)
        else:
            experts = ParallelExperts(e, h, i, silu_and_mul, expert_parallel=True, ep=group)
        experts.gate_up_loader(experts.gate_up_proj, w13)
        experts.down_loader(experts.down_proj, w2)
        experts.pack_weights()
        if mode == "dp2-ep2":
            rows = slice(rank * tokens, (rank + 1) * tokens)
            args_ = (x[rows], ids[rows], weights[rows])
        else:
            args_ = (x, ids, weights)
        exchange_s: list[float] = []
        timed_all_to_all(group, exchange_s)
        calls_ms, exchange_ms = [], []
        for call in range(args.warmup + args.calls):
            dist.barrier()
            exchange_s.clear()
            start = time.perf_counter()
            y = experts(*args_)
            if mode != "dp2-ep2":
                group.all_reduce(y)
            if call >= args.warmup:
                calls_ms.append((time.perf_counter() - start) * 1e3)
                exchange_ms.append(sum(exchange_s) * 1e3)
        out[mode] = {"layer_ms": round(statistics.median(calls_ms), 3)}
        if mode == "dp2-ep2":
            out[mode]["exchange_ms"] = round(statistics.median(exchange_ms), 3)
    dist.destroy_process_group()
    return out


def timed_all_to_all(group: Any, sink: list[float]) -> None:
    """Time every ``all_to_all`` / ``all_to_all_counts`` of ``group`` (a frozen dataclass, so
    the methods are wrapped on the instance's class for this process only)."""
    cls = type(group)
    for name in ("all_to_all", "all_to_all_counts"):
        plain = getattr(cls, f"_plain_{name}", None) or getattr(cls, name)
        setattr(cls, f"_plain_{name}", plain)

        def timed(self: Any, *a: Any, _plain: Any = plain, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return _plain(self, *a, **k)
            finally:
                sink.append(time.perf_counter() - start)

        setattr(cls, name, timed)


def _run(args: argparse.Namespace, tokens: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return run_spawned(_rank_main, 2, args, tokens, port)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, action="append", help="tokens per DP rank")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--inter", type=int, default=384)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    sizes = args.tokens or [32, 512]
    runs = [{t: _run(args, t) for t in sizes} for _ in range(args.runs)]
    conditions = {k: v for k, v in vars(args).items() if k != "tokens"}
    conditions.update(cpu_count=os.cpu_count(), load_average_at_end=os.getloadavg())
    print(json.dumps({"conditions": conditions, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
