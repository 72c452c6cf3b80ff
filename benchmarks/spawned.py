"""Spawned ranks for the multi-process benchmarks (gloo, no Ray): ``run_spawned`` starts one
process per rank and returns what each puts on its result queue."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any


def run_spawned(
    target: Callable[..., None], world: int, *args: Any, timeout_s: float = 900
) -> dict[int, Any]:
    """Run ``target(rank, ports, results, *args)`` in ``world`` spawned processes; each puts
    ``(rank, result)`` on ``results`` (a string: the rank's error, raised here as
    ``RuntimeError``) and may hand a rendezvous port to the others through ``ports``."""
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, ports, results, *args)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, res in out.items():
        if isinstance(res, str):
            raise RuntimeError(f"rank {rank}: {res}")
    return out
