"""Head -> workers -> head round trip of one engine step, per executor.

For each executor it times ``execute_model`` on (a) an empty step (no tokens: pure dispatch and
reply) and (b) a one-token decode step of one request, plus, for the Ray executor, (c) a bare
no-op actor call to every worker, which is the floor any dispatch by Ray actor calls pays. The
Ray executor runs twice in the same run, once per step dispatch: ``tasks`` (one actor call per
worker per step, CPU workers') and ``compiled`` (a Ray Compiled Graph, GPU workers'), chosen
by replacing ``cluster.runtime.step_dispatch.dispatch_for`` as the tests do.

    python benchmarks/tp_step_roundtrip.py --tp 2 --iters 300 --json out.json

Prints the conditions with the figures; ``--json`` also writes them for a script to read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.runtime import step_dispatch
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.worker.executor import Executor, get_executor_class
from engine.worker.step_messages import CachedRequestData, ExecuteModelRequest, NewRequestData

NUM_BLOCKS = 64


def _time(fn: Callable[[], Any], iters: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return {
        "median_ms": statistics.median(samples),
        "mean_ms": statistics.fmean(samples),
        "p90_ms": samples[int(0.9 * (len(samples) - 1))],
        "iters": iters,
    }


def _empty_step() -> ExecuteModelRequest:
    return ExecuteModelRequest(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        finished_req_ids=[],
    )


class DecodeSteps:
    """One request: a 1-token prompt, then one decode token per step (deltas only)."""

    def __init__(self, executor: Executor, block_size: int) -> None:
        self.executor = executor
        self.block_size = block_size
        self.num_computed = 0
        self.round = 0

    def start(self) -> None:
        self.num_computed = 0
        self.round += 1
        new = NewRequestData(
            req_id=f"r{self.round}",
            prompt_token_ids=[1],
            sampling_params=SamplingParams(temperature=0, max_tokens=None),
            block_ids=list(range(NUM_BLOCKS)),
            num_computed_tokens=0,
        )
        self._run(
            ExecuteModelRequest(
                scheduled_new_reqs=[new],
                scheduled_cached_reqs=[],
                num_scheduled_tokens={new.req_id: 1},
                total_num_scheduled_tokens=1,
                finished_req_ids=[f"r{self.round - 1}"],
            )
        )

    def step(self) -> None:
        if self.num_computed + 1 >= NUM_BLOCKS * self.block_size:
            self.start()
            return
        rid = f"r{self.round}"
        cached = CachedRequestData(
            req_id=rid,
            new_token_ids=[self.last],
            new_block_ids=[],
            num_computed_tokens=self.num_computed,
        )
        self._run(
            ExecuteModelRequest(
                scheduled_new_reqs=[],
                scheduled_cached_reqs=[cached],
                num_scheduled_tokens={rid: 1},
                total_num_scheduled_tokens=1,
                finished_req_ids=[],
            )
        )

    def _run(self, request: ExecuteModelRequest) -> None:
        output = self.executor.execute_model(request)
        self.last = output.sampled_token_ids[0][0]
        self.num_computed += 1


def measure(
    backend: str, tp: int, model: str, iters: int, warmup: int, dispatch: str = ""
) -> dict[str, Any]:
    by_device = step_dispatch.dispatch_for
    if dispatch:
        step_dispatch.dispatch_for = lambda resource: dispatch
    config = EngineConfig.from_kwargs(
        model=model,
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
        num_kv_blocks=NUM_BLOCKS,
        device="cpu",
    )
    executor = get_executor_class(config)(config)
    try:
        executor.initialize_cache(NUM_BLOCKS, 0)
        result: dict[str, Any] = {"backend": backend, "tp": tp}
        result["empty_step"] = _time(lambda: executor.execute_model(_empty_step()), iters, warmup)
        if dispatch:
            result["dispatch"] = getattr(executor, "dispatch_mode", dispatch)
        decode = DecodeSteps(executor, config.cache.block_size)
        decode.start()
        result["decode_1_token"] = _time(decode.step, iters, warmup)
        if backend == "ray":
            import ray

            workers = executor.workers
            result["bare_actor_call"] = _time(
                lambda: ray.get([w.ping.remote() for w in workers]), iters, warmup
            )
        return result
    finally:
        executor.shutdown()
        step_dispatch.dispatch_for = by_device


def _all_reduce_rank(rank: int, port_queue: Any, out: Any, iters: int, warmup: int) -> None:
    import torch

    from parallel.distributed import connect_store, create_store, init_distributed

    torch.set_num_threads(1)
    if rank == 0:
        rendezvous = create_store("127.0.0.1", 2)
        port_queue.put(rendezvous.port)
        store = rendezvous.store
    else:
        store = connect_store("127.0.0.1", port_queue.get(), 2)
    ctx = init_distributed(store, rank, 2, 1, torch.device("cpu"))
    x = torch.ones(1, 64)
    stats = _time(lambda: ctx.tp.all_reduce(x), iters, warmup)
    if rank == 0:
        out.put(stats)


def measure_gloo_all_reduce(iters: int, warmup: int) -> dict[str, float]:
    """Latency of one [1, 64] fp32 gloo all-reduce between two processes (a decode step of the
    2-layer model does 5 of them plus one gather)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ports, out = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_all_reduce_rank, args=(r, ports, out, iters, warmup)) for r in range(2)
    ]
    for p in procs:
        p.start()
    stats = out.get(timeout=300)
    for p in procs:
        p.join(timeout=30)
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import ray

    ray.init(
        address="local", num_cpus=max(args.tp, 2), include_dashboard=False, log_to_driver=False
    )
    try:
        runs = [
            measure("uni", 1, args.model, args.iters, args.warmup),
            measure("ray", args.tp, args.model, args.iters, args.warmup, "tasks"),
            measure("ray", args.tp, args.model, args.iters, args.warmup, "compiled"),
        ]
    finally:
        ray.shutdown()
    runs.append(
        {
            "backend": "gloo",
            "tp": 2,
            "all_reduce_1x64": measure_gloo_all_reduce(args.iters, args.warmup),
        }
    )
    report = {
        "model": args.model,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "torch_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "load_average_at_end": os.getloadavg(),
        "runs": runs,
    }
    for run in runs:
        for name, stats in run.items():
            if isinstance(stats, dict):
                label = (
                    f"{run['backend']}/{run['dispatch']}" if "dispatch" in run else run["backend"]
                )
                head = f"{label:>12} tp={run['tp']} {name:<15}"
                print(
                    f"{head} median {stats['median_ms']:7.3f} ms  mean {stats['mean_ms']:7.3f} ms"
                    f"  p90 {stats['p90_ms']:7.3f} ms  ({stats['iters']} iters)"
                )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
