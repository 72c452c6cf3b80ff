"""Pipelined PP on Ray workers: with pipeline_parallel_size 2 the engine keeps two batches in
flight (stage 0 computes one while stage 1 computes the other), token-for-token equal to one
batch at a time and to TP = PP = 1, under chunked prefill, preemption and seeded sampling.
The Ray cluster starts with ``OMP_NUM_THREADS`` above one, as a user's shell may export it: each
stage still computes on one thread per CPU its bundle reserves.
"""

from __future__ import annotations

import random

import pytest
import ray

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.local_ray(num_cpus=4, env={"OMP_NUM_THREADS": "2"})]

ARGS = {
    "max_model_len": 256,
    "device": "cpu",
    "dtype": "float32",
    # Small: prompts are chunked and running requests preempt one another.
    "num_kv_blocks": 20,
    "block_size": 8,
    "max_num_batched_tokens": 32,
    "enable_chunked_prefill": True,
}


def _workload() -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(5)
    prompts = [
        {"prompt_token_ids": [rng.randrange(1000) for _ in range(9 + 11 * i)]} for i in range(6)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=12 + 4 * i, ignore_eos=True) for i in range(6)
    ]
    params[2] = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    return prompts, params


def _generate(llm: LLM) -> list[list[int]]:
    prompts, params = _workload()
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def single() -> list[list[int]]:
    return _generate(LLM("builtin:tiny-llama", distributed_executor_backend="uni", **ARGS))


def test_two_batches_in_flight_are_token_equal_to_tp1(single: list[list[int]]) -> None:
    llm = LLM("builtin:tiny-llama", pipeline_parallel_size=2, **ARGS)
    engine = llm.llm_engine
    assert engine.executor.max_concurrent_batches == 2
    # Two stages busy at once with the driver's two threads each would oversubscribe the cores.
    assert ray.get([w.num_threads.remote() for w in engine.executor.workers]) == [1, 1]
    prompts, params = _workload()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"probe{i}", prompt, p)
    engine.step()  # sent two batches, took the first: the second is still in flight
    assert engine.request_state_sizes()["batches_in_flight"] == 1
    engine.abort_request([f"probe{i}" for i in range(6)])
    while engine.has_unfinished_requests():
        engine.step()
    assert sum(engine.request_state_sizes().values()) == 0
    assert engine.executor.collective_rpc("num_request_states") == [0, 0]
    assert _generate(llm) == single
    assert engine.scheduler.num_preemptions > 0


def test_one_batch_at_a_time_is_token_equal_too(
    single: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLM_CLUSTER_PP_PIPELINING", "0")
    llm = LLM("builtin:tiny-llama", pipeline_parallel_size=2, **ARGS)
    assert llm.llm_engine.executor.max_concurrent_batches == 1
    assert _generate(llm) == single
