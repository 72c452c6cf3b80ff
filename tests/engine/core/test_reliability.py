"""Isolation and reliability contracts of the engine: requests with different ``cache_salt``
never share KV blocks, a request past its deadline is aborted with its blocks freed, and seeded
sampling gives the same tokens alone or in a concurrent batch (RELIABILITY.md)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest

from engine import EngineOverloadedError, InvalidRequestError, SamplingParams
from engine.client.async_llm_engine import AsyncLLMEngine, StreamOutput
from engine.core.llm_engine import LLMEngine
from engine.outputs import RequestOutput

MODEL = "builtin:tiny-llama"
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


@pytest.fixture(scope="module")
def llm_engine() -> LLMEngine:
    return LLMEngine.from_engine_args(model=MODEL, num_kv_blocks=128, device="cpu")


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine.from_engine_args(model=MODEL, num_kv_blocks=64, device="cpu")
    yield engine
    engine.shutdown()


def run(engine: LLMEngine, rid: str, prompt: list[int], salt: str | None) -> RequestOutput:
    engine.add_request(rid, {"prompt_token_ids": prompt}, GREEDY, cache_salt=salt)
    while True:
        for output in engine.step():
            if output.request_id == rid and output.finished:
                return output


# ---- cache_salt -----------------------------------------------------------------------------


def test_same_salt_reuses_the_prefix_and_another_salt_does_not(llm_engine: LLMEngine) -> None:
    prompt = _ids(1, 64)
    first = run(llm_engine, "salt-a1", prompt, "tenant-a")
    other_tenant = run(llm_engine, "salt-b1", prompt, "tenant-b")
    unsalted = run(llm_engine, "salt-none", prompt, None)
    same_tenant = run(llm_engine, "salt-a2", prompt, "tenant-a")
    assert first.num_cached_tokens == 0
    assert other_tenant.num_cached_tokens == 0
    assert unsalted.num_cached_tokens == 0
    assert same_tenant.num_cached_tokens >= 48
    assert same_tenant.outputs[0].token_ids == first.outputs[0].token_ids


def test_concurrent_requests_of_different_salts_hold_disjoint_blocks(
    llm_engine: LLMEngine,
) -> None:
    prompt = {"prompt_token_ids": _ids(2, 64)}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm_engine.add_request("iso-a", prompt, params, cache_salt="tenant-a")
    llm_engine.step()  # a's prompt blocks are computed and cached
    llm_engine.add_request("iso-b", prompt, params, cache_salt="tenant-b")
    llm_engine.add_request("iso-a2", prompt, params, cache_salt="tenant-a")
    llm_engine.step()
    blocks = {
        r: set(llm_engine.block_manager.get_block_ids(r)) for r in ("iso-a", "iso-b", "iso-a2")
    }
    assert blocks["iso-a"] & blocks["iso-a2"]  # the same tenant shares its prefix
    assert not blocks["iso-b"] & (blocks["iso-a"] | blocks["iso-a2"])
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
    llm_engine.check_integrity()


@pytest.mark.parametrize("salt", ["", 7])
def test_cache_salt_must_be_a_non_empty_string(llm_engine: LLMEngine, salt: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm_engine.add_request("bad-salt", "hi", GREEDY, cache_salt=salt)  # type: ignore[arg-type]
    assert info.value.param == "cache_salt"
    assert not llm_engine.has_unfinished_requests()


# ---- admission control ----------------------------------------------------------------------


SEATS = 3


@pytest.fixture(scope="module")
def full() -> LLMEngine:
    """Three running sequences at most; at most two samples or 100 prompt tokens waiting."""
    return LLMEngine.from_engine_args(
        model=MODEL, num_kv_blocks=128, device="cpu", max_num_seqs=SEATS,
        max_waiting_requests=2, max_waiting_tokens=100,
    )  # fmt: skip


LONG = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def occupy(engine: LLMEngine) -> None:
    """Fill every seat, so that every later request waits."""
    for i in range(SEATS):
        engine.add_request(f"running-{i}", {"prompt_token_ids": _ids(50 + i, 8)}, LONG)
        engine.step()
    assert (len(engine.scheduler.running), engine.scheduler.num_waiting) == (SEATS, 0)


def drain(engine: LLMEngine) -> None:
    engine.abort_request(list(engine.scheduler.requests))
    engine.step()
    engine.check_integrity()


def test_request_beyond_max_waiting_requests_is_refused_and_not_enqueued(
    full: LLMEngine,
) -> None:
    occupy(full)
    try:
        full.add_request("w1", {"prompt_token_ids": _ids(6, 8)}, LONG)
        full.add_request("w2", {"prompt_token_ids": _ids(7, 8)}, LONG)
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests") as info:
            full.add_request("w3", {"prompt_token_ids": _ids(8, 8)}, LONG)
        assert info.value.retry_after_s >= 1
        assert "w3" not in full.scheduler.requests
        full.abort_request("w2")
        full.add_request("w3", {"prompt_token_ids": _ids(8, 8)}, LONG)  # room again
    finally:
        drain(full)


def test_n_samples_count_against_max_waiting_requests(full: LLMEngine) -> None:
    occupy(full)
    try:
        full.add_request("w1", {"prompt_token_ids": _ids(6, 8)}, LONG)
        with pytest.raises(EngineOverloadedError):
            full.add_request("pair", "hi", LONG.clone(n=2))
    finally:
        drain(full)


def test_prompt_tokens_beyond_max_waiting_tokens_are_refused(full: LLMEngine) -> None:
    occupy(full)
    try:
        full.add_request("w1", {"prompt_token_ids": _ids(6, 60)}, LONG)
        with pytest.raises(EngineOverloadedError, match="max_waiting_tokens"):
            full.add_request("w2", {"prompt_token_ids": _ids(7, 60)}, LONG)
        full.add_request("w3", {"prompt_token_ids": _ids(8, 30)}, LONG)  # 90 tokens fit
    finally:
        drain(full)


def test_an_empty_queue_admits_a_request_larger_than_the_caps(full: LLMEngine) -> None:
    occupy(full)
    try:
        full.add_request("big", {"prompt_token_ids": _ids(9, 300)}, LONG.clone(n=3))
    finally:
        drain(full)


def test_invalid_request_is_a_validation_error_even_when_overloaded(full: LLMEngine) -> None:
    occupy(full)
    try:
        full.add_request("w1", {"prompt_token_ids": _ids(6, 8)}, LONG)
        full.add_request("w2", {"prompt_token_ids": _ids(7, 8)}, LONG)
        with pytest.raises(InvalidRequestError) as info:
            full.add_request("bad", "hi", SamplingParams(top_p=1.0, max_tokens=5000))
        assert info.value.param == "max_tokens"
    finally:
        drain(full)


# ---- deadlines ------------------------------------------------------------------------------


async def collect(
    engine: AsyncLLMEngine, prompt: object, params: SamplingParams, **kw: object
) -> list[StreamOutput]:
    return [item async for item in engine.generate(prompt, params, **kw)]  # type: ignore[arg-type]


def test_request_past_its_deadline_is_aborted_and_its_blocks_freed(
    engine: AsyncLLMEngine,
) -> None:
    long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
    start = time.monotonic()
    items = asyncio.run(collect(engine, "Once upon a time", long, timeout_s=0.2))
    elapsed = time.monotonic() - start
    final = items[-1].output.outputs[0]
    assert final.finish_reason == "abort"
    assert len(final.token_ids) < 900
    assert elapsed < 5.0
    stats = asyncio.run(engine.get_stats())
    assert stats.kv_free_blocks == stats.kv_total_blocks
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert _no_request_state(asyncio.run(engine.request_state()))


def _no_request_state(state: dict[str, object]) -> bool:
    return all(v == 0 for v in state["head"].values()) and not any(state["workers"])


def test_aborting_the_only_request_leaves_no_state_on_head_or_workers(
    engine: AsyncLLMEngine,
) -> None:
    """An abort while nothing else runs must not leave the request's state on the workers
    until some later step: an idle engine holds no per-request state anywhere."""

    async def scenario() -> tuple[dict[str, object], dict[str, object]]:
        stream = engine.generate("Once upon a time", SamplingParams(max_tokens=500))
        await stream.__anext__()
        during = await engine.request_state()
        await stream.aclose()
        await asyncio.sleep(0.2)  # the abort runs on the engine thread
        return during, await engine.request_state()

    during, after = asyncio.run(scenario())
    assert not _no_request_state(during)  # the check can see a live request
    assert _no_request_state(after), after


def test_request_within_its_deadline_finishes_normally(engine: AsyncLLMEngine) -> None:
    items = asyncio.run(collect(engine, "Once upon a time", GREEDY, timeout_s=60))
    assert items[-1].finish_reason == "length"


@pytest.mark.parametrize("timeout", [0, -1.0, "5"])
def test_invalid_timeout_is_rejected_naming_it(engine: AsyncLLMEngine, timeout: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(collect(engine, "hi", GREEDY, timeout_s=timeout))
    assert info.value.param == "timeout"


# ---- determinism ----------------------------------------------------------------------------


SEEDED = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=77, max_tokens=24)


async def tokens_alone(engine: AsyncLLMEngine) -> list[int]:
    items = await collect(engine, {"prompt_token_ids": _ids(3, 30)}, SEEDED)
    return list(items[-1].output.outputs[0].token_ids)


async def tokens_in_a_batch(engine: AsyncLLMEngine) -> list[int]:
    others = [
        collect(engine, {"prompt_token_ids": _ids(10 + i, 12 + 9 * i)},
                SamplingParams(temperature=0.8, max_tokens=16 + 5 * i, seed=i if i % 2 else None))
        for i in range(5)
    ]  # fmt: skip
    results = await asyncio.gather(*others[:2], tokens_alone(engine), *others[2:])
    return results[2]  # type: ignore[return-value]


def test_seeded_output_is_identical_alone_repeated_and_in_a_concurrent_batch(
    engine: AsyncLLMEngine,
) -> None:
    alone = asyncio.run(tokens_alone(engine))
    again = asyncio.run(tokens_alone(engine))
    batched = asyncio.run(tokens_in_a_batch(engine))
    assert len(alone) == 24
    assert again == alone
    assert batched == alone
