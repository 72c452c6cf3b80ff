"""Spawned ranks for the multi-process tests of tests/engine and tests/parallel (TP, PP and EP
on gloo, no Ray): ``run_ranks`` starts one process per rank and collects what each returns,
failing the test with a rank's error; ``greedy_steps`` drives a ``Worker`` directly as the head
would (prefill every prompt, then decode steps, the driver rank's samples broadcast to the
others)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from engine import SamplingParams
from engine.config import EngineConfig


def run_ranks(
    target: Callable[..., None], world: int, *args: Any, timeout_s: float = 300
) -> dict[int, Any]:
    """Run ``target(rank, ports, results, *args)`` in ``world`` spawned processes; each puts
    ``(rank, result)`` on ``results`` (a string: the rank's error) and rank 0 hands its
    rendezvous port to the others through ``ports``. Returns every rank's result."""
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, ports, results, *args)) for r in range(world)]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, out = results.get(timeout=timeout_s)
            collected[rank] = out
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(collected))} did not answer")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    for rank, out in collected.items():
        if isinstance(out, str):
            pytest.fail(f"rank {rank} failed: {out}")
    return collected


def rank_config(rank: int, **kwargs: Any) -> EngineConfig:
    """``EngineConfig.from_kwargs(**kwargs)`` as rank ``rank`` of its parallel group sees it."""
    config = EngineConfig.from_kwargs(**kwargs)
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, rank=rank))


def rendezvous(worker: Any, rank: int, world: int, ports: Any) -> None:
    """Join ``world`` ranks' process group: rank 0 opens it and posts its port once per peer."""
    if rank == 0:
        port = worker.start_rendezvous("127.0.0.1")
        for _ in range(world - 1):
            ports.put(port)
    else:
        port = ports.get(timeout=60)
    worker.init_distributed("127.0.0.1", port)


def workers_on_one_group(
    rank: int, world: int, ports: Any, configs: dict[str, Any]
) -> Iterator[tuple[str, Any]]:
    """One loaded ``Worker`` (64-block cache) per ``configs`` entry on this rank, all on the
    process group the first one joins (a rank's group outlives one model); the group ends
    after the last."""
    from engine.worker.worker import Worker

    first = None
    try:
        for name, config in configs.items():
            worker = Worker(config)
            worker.init_device()
            if first is None:
                rendezvous(worker, rank, world, ports)
                first = worker
            else:
                worker.ctx = first.ctx
            worker.load_model()
            worker.initialize_cache(64, 0)
            yield name, worker
    finally:
        if first is not None:
            first.shutdown()


def _block_table(worker: Any, index: int, blocks_per_request: int) -> list[int]:
    """Request ``index``'s blocks ``[index * n, (index + 1) * n)`` in every KV cache group (as
    global ids, groups one after the other; a sliding group's from its block 1 on, past its
    null block), as the head's block manager would send them."""
    layout = worker.runner.cache_engine.layout
    first = index * blocks_per_request
    return [
        offset + int(spec.is_sliding) + first + b
        for spec, offset in zip(layout.specs, layout.offsets)
        for b in range(blocks_per_request)
    ]


def greedy_steps(
    worker: Any,
    prompts: list[list[int]],
    steps: int,
    *,
    prefix: str = "r",
    blocks_per_request: int = 4,
    driver_rank: int = 0,
    idle_before: int = 0,
    idle_after: int = 0,
    group: Any = None,
    mm_features: list[list[Any]] | None = None,
    mrope: list[Any] | None = None,
) -> list[list[int]]:
    """Prefill every prompt, then ``steps`` decode steps; the tokens each request got. The
    driver rank (the last stage's first) samples and tells the others, as the head would
    through its next message: over the world, or over ``group`` (a ``GroupCoordinator``: a
    data-parallel rank's TP group) when given. ``idle_before`` / ``idle_after``: steps with
    nothing scheduled before the prefill and after the last decode step (a data-parallel core
    without requests still steps with the others). ``mm_features``: each prompt's images
    (``MultiModalFeature``s, as the head's input processing makes them); ``mrope``: each
    prompt's M-RoPE positions (``MRopePositions`` or None)."""
    import torch.distributed as dist

    from engine.worker.step_messages import (
        CachedRequestData,
        ExecuteModelRequest,
        NewRequestData,
        empty_request,
    )

    nothing = empty_request()
    for _ in range(idle_before):
        worker.execute_model(nothing)

    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    request = ExecuteModelRequest(
        scheduled_new_reqs=[
            NewRequestData(
                req_id=rid,
                prompt_token_ids=prompt,
                sampling_params=params,
                block_ids=_block_table(worker, i, blocks_per_request),
                num_computed_tokens=0,
                mm_features=mm_features[i] if mm_features else [],
                mrope=mrope[i] if mrope else None,
            )
            for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True))
        ],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={rid: len(p) for rid, p in zip(ids, prompts, strict=True)},
        total_num_scheduled_tokens=sum(map(len, prompts)),
        finished_req_ids=[],
    )
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(steps + 1):
        output = worker.execute_model(request)
        box = [output.sampled_token_ids if output is not None else None]
        if group is not None:
            if group.size > 1:
                dist.broadcast_object_list(box, src=driver_rank, group=group.group)
        elif dist.is_initialized():
            dist.broadcast_object_list(box, src=driver_rank)
        sampled = [t[0] for t in box[0]]
        for i, t in enumerate(sampled):
            tokens[i].append(t)
        request = ExecuteModelRequest(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=[
                CachedRequestData(
                    req_id=rid,
                    new_token_ids=[t],
                    new_block_ids=[],
                    num_computed_tokens=len(p) + step,
                )
                for rid, p, t in zip(ids, prompts, sampled, strict=True)
            ],
            num_scheduled_tokens=dict.fromkeys(ids, 1),
            total_num_scheduled_tokens=len(ids),
            finished_req_ids=[],
        )
    for _ in range(idle_after):
        worker.execute_model(nothing)
    return tokens
