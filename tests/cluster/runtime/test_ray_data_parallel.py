"""Data-parallel attention with wide expert parallelism on a local Ray (CPU, gloo):
``data_parallel_size`` 2 engine cores, each with its own scheduler, KV cache and requests, the
MoE experts split over both cores' workers. Every request's greedy tokens equal TP = 1's, with
chunked prefill, preemption, and one core idle for several steps while the other decodes."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.core.data_parallel import DataParallelEngine

ENGINE_ARGS: dict[str, Any] = {
    "max_num_batched_tokens": 32,
    "enable_chunked_prefill": True,
    "max_model_len": 256,
    "device": "cpu",
    "dtype": "float32",
}
MODELS = ("tiny-qwen3-moe", "tiny-deepseek-v3")
MAX_TOKENS = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(5, 1000) for _ in range(n)] for n in (3, 30, 75, 120, 7, 50)]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _expected(model: str) -> list[list[int]]:
    llm = LLM(f"builtin:{model}", distributed_executor_backend="uni", **ENGINE_ARGS)
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in _prompts()], _params(), use_tqdm=False
        )
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module", params=MODELS)
def dp2(request: pytest.FixtureRequest) -> Iterator[tuple[str, LLM]]:
    # 14 blocks of 16 tokens per core: the longest request alone needs 9, so a core holding
    # it and another long one preempts.
    llm = LLM(
        f"builtin:{request.param}", data_parallel_size=2, enable_expert_parallel=True,
        num_kv_blocks=14, **ENGINE_ARGS,
    )  # fmt: skip
    try:
        yield request.param, llm
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_dp2_greedy_tokens_equal_tp1_with_chunked_prefill_and_preemption(
    dp2: tuple[str, LLM],
) -> None:
    model, llm = dp2
    engine = llm.llm_engine
    assert isinstance(engine, DataParallelEngine) and len(engine.cores) == 2
    preempted = engine.counters().num_preemptions
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], _params(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == _expected(model)
    assert engine.counters().num_preemptions > preempted, "the run was meant to preempt"
    # Nothing is left behind on either core.
    assert engine.request_state_sizes()["data_parallel_owners"] == 0
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_a_core_idle_for_several_steps_then_busy_keeps_tp1_tokens(dp2: tuple[str, LLM]) -> None:
    model, llm = dp2
    engine = llm.llm_engine
    assert isinstance(engine, DataParallelEngine)
    prompts = _prompts()
    tokens: dict[str, list[int]] = {}

    def add(i: int) -> None:
        engine.add_request(f"idle-{i}", {"prompt_token_ids": prompts[i]}, _params())

    def step() -> None:
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)

    add(0)  # core 0 takes it; core 1 has nothing and steps idle with it
    for _ in range(6):
        step()
    owners = {id(core): core.get_num_unfinished_requests() for core in engine.cores}
    assert sorted(owners.values()) == [0, 1]
    for i in range(1, len(prompts)):
        add(i)
    assert all(core.get_num_unfinished_requests() >= 2 for core in engine.cores)
    while engine.has_unfinished_requests():
        step()
    expected = _expected(model)
    assert [tokens[f"idle-{i}"] for i in range(len(prompts))] == expected
