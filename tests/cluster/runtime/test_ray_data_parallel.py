"""Data-parallel attention with wide expert parallelism on a Ray of two nodes simulated on this
machine (``ray.cluster_utils.Cluster``: two nodes of 2 CPUs; CPU, gloo): ``data_parallel_size``
2 engine cores, each with its own scheduler, KV cache and requests and a TP group of 1 or 2
workers, the MoE experts split over all of them (EP 2 or 4). At TP 2 each DP rank's group has a
node to itself, so the tokens are exchanged across nodes. Every request's greedy tokens equal
TP = 1's, with chunked prefill, preemption, and one core idle for several steps while the other
decodes; a request goes to the core holding its prefix."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.core.data_parallel import DataParallelEngine
from tests.cluster.conftest import simulated_nodes

ENGINE_ARGS: dict[str, Any] = {
    "max_num_batched_tokens": 32,
    "enable_chunked_prefill": True,
    "max_model_len": 256,
    "device": "cpu",
    "dtype": "float32",
}
MODELS = ("tiny-qwen3-moe", "tiny-deepseek-v3")
MAX_TOKENS = 12

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def two_nodes() -> Iterator[Any]:
    """This module's Ray: a head offering no CPU and two nodes of 2 CPUs, stopped after it."""
    with simulated_nodes(0, [2, 2]) as cluster:
        yield cluster


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


@pytest.fixture(
    scope="module",
    params=[(model, tp) for model in MODELS for tp in (1, 2)],
    ids=lambda p: f"{p[0]}-dp2-tp{p[1]}",
)
def dp2(request: pytest.FixtureRequest) -> Iterator[tuple[str, LLM]]:
    # 14 blocks of 16 tokens per core: the longest request alone needs 9, so a core holding
    # it and another long one preempts.
    import ray

    model, tp = request.param
    llm = LLM(
        f"builtin:{model}", data_parallel_size=2, tensor_parallel_size=tp,
        enable_expert_parallel=True, num_kv_blocks=14, **ENGINE_ARGS,
    )  # fmt: skip
    try:
        if tp == 2:
            workers = llm.llm_engine.executor.workers
            node_of_rank = ray.get([w.node_id.remote() for w in workers])
            # rank = dp_rank * TP + tp_rank: ranks 0-1 are DP rank 0's group, 2-3 DP rank 1's.
            assert node_of_rank[0] == node_of_rank[1] != node_of_rank[2] == node_of_rank[3]
        yield model, llm
    finally:
        llm.llm_engine.shutdown()


def _dp_engine(llm: LLM) -> DataParallelEngine:
    engine = llm.llm_engine
    assert isinstance(engine, DataParallelEngine) and len(engine.cores) == 2
    return engine


def test_dp2_greedy_tokens_equal_tp1_with_chunked_prefill_and_preemption(
    dp2: tuple[str, LLM],
) -> None:
    model, llm = dp2
    engine = _dp_engine(llm)
    preempted = engine.counters().num_preemptions
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], _params(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == _expected(model)
    assert engine.counters().num_preemptions > preempted, "the run was meant to preempt"
    # Nothing is left behind on either core; per-core loads (per-core /metrics) add up.
    assert engine.request_state_sizes()["data_parallel_owners"] == 0
    assert not engine.has_unfinished_requests()
    loads = engine.core_loads()
    assert len(loads) == 2 and all(usage == 0.0 for _, usage in loads)
    assert sum(c.num_preemptions for c, _ in loads) == engine.counters().num_preemptions


def test_a_core_idle_for_several_steps_then_busy_keeps_tp1_tokens(dp2: tuple[str, LLM]) -> None:
    model, llm = dp2
    engine = _dp_engine(llm)
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


def test_a_request_goes_to_the_core_holding_its_prefix_then_to_the_least_loaded(
    dp2: tuple[str, LLM],
) -> None:
    engine = _dp_engine(dp2[1])
    shared = list(range(100, 164))  # four full blocks

    def add(rid: str, prompt: list[int]) -> None:
        engine.add_request(rid, {"prompt_token_ids": prompt}, _params())

    def owner(rid: str) -> int:
        return engine.cores.index(engine._owner[rid])

    add("prefix-a", [*shared, 1, 2, 3])  # both cores idle and empty: the lowest index
    assert owner("prefix-a") == 0
    while engine.has_unfinished_requests():
        engine.step()
    add("other", [7] * 20)  # no prefix cached anywhere, both idle: core 0 again
    add("prefix-b", [*shared, 4, 5])  # core 0 holds its prefix: core 0, though it is busier
    add("another", [9] * 20)  # no prefix: the less loaded core
    assert [owner(r) for r in ("other", "prefix-b", "another")] == [0, 0, 1]
    hits = engine.cores[0].counters().prefix_cache_hits
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cores[0].counters().prefix_cache_hits >= hits + len(shared)


def test_a_text_prompt_is_tokenized_once_to_choose_the_core_and_run_on_it(
    dp2: tuple[str, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _dp_engine(dp2[1])
    encoded: list[str] = []
    every = [engine.inputs.tokenizer]
    every += [t for c in engine.cores for t in (c.tokenizer, c.inputs.tokenizer)]
    tokenizers = {id(t): t for t in every}
    for tokenizer in tokenizers.values():

        def encode(text: str, *args: Any, _encode: Any = tokenizer.encode, **kw: Any) -> Any:
            encoded.append(text)
            return _encode(text, *args, **kw)

        monkeypatch.setattr(tokenizer, "encode", encode)
    engine.add_request("text", "Paris is the capital of", _params())
    assert encoded == ["Paris is the capital of"]
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].prompt == "Paris is the capital of"
