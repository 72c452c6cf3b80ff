"""AsyncLLMEngine: streams equal the offline engine, aborts free blocks within a step, errors
reach the caller (validation) or every stream (engine death), and the event loop stays free."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engine import LLM, EngineDeadError, InvalidRequestError, SamplingParams
from engine.client import async_llm_engine, core_loop
from engine.client.async_llm_engine import AsyncLLMEngine, ChoiceDelta, StreamOutput

MODEL = "builtin:tiny-llama"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine.from_engine_args(model=MODEL, num_kv_blocks=64)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, num_kv_blocks=64)


async def collect(
    engine: AsyncLLMEngine, prompt: str, params: SamplingParams
) -> list[StreamOutput]:
    return [item async for item in engine.generate(prompt, params)]


def test_stream_matches_offline_llm(engine: AsyncLLMEngine, offline: LLM) -> None:
    items = asyncio.run(collect(engine, "The quick brown fox", GREEDY))
    expected = offline.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0]
    assert items[-1].output.outputs[0].token_ids == expected.token_ids
    assert items[-1].text == expected.text
    assert [t for i in items for t in i.delta_token_ids] == expected.token_ids
    assert "".join(i.delta_text for i in items) == expected.text
    assert items[-1].finish_reason == "length"


def test_concurrent_streams_each_match_offline(engine: AsyncLLMEngine, offline: LLM) -> None:
    prompts = ["one two", "a much longer prompt with more words in it", "x"]

    async def run_all() -> list[list[StreamOutput]]:
        return await asyncio.gather(*(collect(engine, p, GREEDY) for p in prompts))

    streams = asyncio.run(run_all())
    expected = offline.generate(prompts, GREEDY, use_tqdm=False)
    for items, ref in zip(streams, expected, strict=True):
        assert items[-1].output.outputs[0].token_ids == ref.outputs[0].token_ids


def test_stop_string_deltas_never_include_the_stop(engine: AsyncLLMEngine, offline: LLM) -> None:
    full = offline.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full[8:11]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    items = asyncio.run(collect(engine, "Hello", params))
    streamed = "".join(i.delta_text for i in items)
    assert streamed == items[-1].text == full[: full.index(stop)]
    assert items[-1].finish_reason == "stop"


def per_choice(items: list[StreamOutput], n: int) -> list[list[ChoiceDelta]]:
    return [[d for i in items for d in i.deltas if d.index == k] for k in range(n)]


SAMPLED_3 = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)


def test_n_choices_stream_their_own_deltas_matching_offline(
    engine: AsyncLLMEngine, offline: LLM
) -> None:
    items = asyncio.run(collect(engine, "Seeded", SAMPLED_3))
    expected = offline.generate("Seeded", SAMPLED_3, use_tqdm=False)[0].outputs
    for deltas, ref in zip(per_choice(items, 3), expected, strict=True):
        assert "".join(d.text for d in deltas) == ref.text
        assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert len({tuple(c.token_ids) for c in expected}) > 1  # the choices really differ


def test_each_choice_reports_its_finish_exactly_once(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    items = asyncio.run(collect(engine, "finish", params))
    for deltas in per_choice(items, 2):
        assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_tokens == 8


def test_stop_string_holdback_is_per_choice(engine: AsyncLLMEngine, offline: LLM) -> None:
    probe = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    texts = [c.text for c in offline.generate("Hold", probe, use_tqdm=False)[0].outputs]
    stop = texts[1][10:13]  # a stop string that choice 1 produces
    items = asyncio.run(collect(engine, "Hold", probe.clone(stop=[stop])))
    final = items[-1].output.outputs
    for deltas, out in zip(per_choice(items, 2), final, strict=True):
        streamed = "".join(d.text for d in deltas)
        assert streamed == out.text and stop not in streamed
    assert final[1].text == texts[1][: texts[1].index(stop)]
    assert final[1].finish_reason == "stop"


def test_delta_logprobs_are_those_of_the_delta_tokens(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, logprobs=2)
    items = asyncio.run(collect(engine, "Logprobs", params))
    for deltas, out in zip(per_choice(items, 2), items[-1].output.outputs, strict=True):
        streamed = [entry for d in deltas for entry in d.logprobs]
        assert streamed == out.logprobs
        assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
        tokens = [t for d in deltas for t in d.token_ids]
        assert [next(iter(entry)) for entry in streamed] == tokens  # the sampled token first


def test_invalid_request_raises_before_anything_is_enqueued(engine: AsyncLLMEngine) -> None:
    async def run() -> None:
        with pytest.raises(InvalidRequestError) as info:
            async for _ in engine.generate("hi", SamplingParams(max_tokens=100_000)):
                pass
        assert info.value.param == "max_tokens"
        stats = await engine.get_stats()
        assert (stats.num_running, stats.num_waiting) == (0, 0)

    asyncio.run(run())


def test_n_over_the_cap_is_rejected_before_any_per_choice_state(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The front's stream and the core's tracker keep an entry per choice: built for an
    # unchecked n of 10**12, they would hold the event loop (and memory) long before the
    # engine's max_n check said 400.
    built: list[int] = []
    start, tracker = async_llm_engine._Stream.start, core_loop._RequestTracker.__init__

    def counting_start(self: Any, request_id: str, prompt: Any, ids: Any, params: Any) -> None:
        built.append(params.n)
        start(self, request_id, prompt, ids, params)

    def counting_tracker(self: Any, params: SamplingParams) -> None:
        built.append(params.n)
        tracker(self, params)

    monkeypatch.setattr(async_llm_engine._Stream, "start", counting_start)
    monkeypatch.setattr(core_loop._RequestTracker, "__init__", counting_tracker)

    async def run() -> None:
        with pytest.raises(InvalidRequestError, match="max_n") as info:
            async for _ in engine.generate("hi", SamplingParams(n=10**12)):
                pass
        assert info.value.param == "n"

    asyncio.run(run())
    assert built == []


def test_duplicate_request_id_is_rejected(engine: AsyncLLMEngine) -> None:
    async def run() -> None:
        first = engine.generate("hi", SamplingParams(max_tokens=500), request_id="same")
        await first.__anext__()
        with pytest.raises(InvalidRequestError, match="already in use"):
            await engine.generate("hi", GREEDY, request_id="same").__anext__()
        await first.aclose()

    asyncio.run(run())


def test_closing_a_stream_aborts_it_and_frees_its_blocks(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The core's step count when the abort is enqueued, read on the caller's thread: counting
    # from a stats reply instead would also count the steps the core runs while this thread
    # waits for the GIL to resume, which under load is more than one.
    steps_at_abort: list[int] = []
    enqueue_abort = engine.client.abort

    def abort(request_ids: list[str]) -> None:
        steps_at_abort.append(engine.client.loop._num_steps)
        enqueue_abort(request_ids)

    monkeypatch.setattr(engine.client, "abort", abort)

    async def run() -> None:
        stream = engine.generate("abort me", SamplingParams(max_tokens=500, ignore_eos=True))
        await stream.__anext__()
        during = await engine.get_stats()
        await stream.aclose()
        after = await engine.get_stats()
        assert during.kv_free_blocks < during.kv_total_blocks
        assert (after.num_running, after.num_waiting) == (0, 0)
        assert after.kv_free_blocks == after.kv_total_blocks
        # Aborted within one step: at most the step already running when the abort was
        # enqueued completes; the abort is drained before the next one.
        assert len(steps_at_abort) == 1
        assert after.num_steps - steps_at_abort[0] <= 1

    asyncio.run(run())
    engine.engine.check_integrity()


def test_cancelled_consumer_task_aborts_the_request(engine: AsyncLLMEngine) -> None:
    async def run() -> None:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("cancel me", SamplingParams(max_tokens=500)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await engine.get_stats()
        assert stats.num_running + stats.num_waiting == 0
        assert stats.kv_free_blocks == stats.kv_total_blocks

    asyncio.run(run())


def test_explicit_abort_ends_the_stream_with_abort(engine: AsyncLLMEngine) -> None:
    async def run() -> StreamOutput:
        last = None
        async for item in engine.generate("x", SamplingParams(max_tokens=500), request_id="ab"):
            last = item
            if not item.finished:
                await engine.abort("ab")
        return last

    assert asyncio.run(run()).finish_reason == "abort"


def test_an_abort_while_the_core_adds_the_request_is_sent_once_the_add_is_done(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head in another process takes the add and the abort as two calls, so an abort sent
    while the add is on its way can be handled first and find nothing (a drain aborting a
    request just sent): the abort waits for the add, and the request ends with "abort"."""
    real_add = engine.client.add_request

    async def run() -> StreamOutput | None:
        release = asyncio.Event()

        async def slow_add(request: Any) -> Any:  # the add still on its way to the core
            await release.wait()
            return await real_add(request)

        monkeypatch.setattr(engine.client, "add_request", slow_add)
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        last = None

        async def consume() -> None:
            nonlocal last
            async for item in engine.generate("x", params, request_id="adding"):
                last = item

        task = asyncio.create_task(consume())
        while "adding" not in engine._adding:
            await asyncio.sleep(0.01)
        await engine.abort("adding")
        release.set()
        await asyncio.wait_for(task, 60)
        return last

    last = asyncio.run(run())
    assert last is not None and last.finish_reason == "abort"
    assert not engine._adding


def test_event_loop_keeps_running_during_forward_passes() -> None:
    engine = AsyncLLMEngine.from_engine_args(model=MODEL, num_kv_blocks=32)
    real_execute = engine.engine.executor.execute_model

    def slow_execute(request):  # a forward pass that holds the engine thread for 50 ms
        time.sleep(0.05)
        return real_execute(request)

    engine.engine.executor.execute_model = slow_execute

    async def run() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        task = asyncio.create_task(ticker())
        await collect(engine, "tick", SamplingParams(max_tokens=8, ignore_eos=True))
        task.cancel()
        return ticks

    try:
        # 8 steps x 50 ms = 400 ms of forward passes; a blocked loop would tick ~0 times.
        assert asyncio.run(run()) > 20
    finally:
        engine.shutdown()


def test_engine_failure_reaches_every_stream_and_health() -> None:
    engine = AsyncLLMEngine.from_engine_args(model=MODEL, num_kv_blocks=32)
    real_execute = engine.engine.executor.execute_model
    calls = 0

    def failing_execute(request):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise EngineDeadError("worker 0 died")
        return real_execute(request)

    engine.engine.executor.execute_model = failing_execute

    async def run() -> list[BaseException]:
        async def one(prompt: str) -> BaseException:
            with pytest.raises(EngineDeadError) as info:
                await collect(engine, prompt, SamplingParams(max_tokens=50, ignore_eos=True))
            return info.value

        return await asyncio.gather(one("a"), one("b"))

    try:
        errors = asyncio.run(run())
        assert all("worker 0 died" in str(e) for e in errors)
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(engine, "after", SamplingParams(max_tokens=2)))
    finally:
        engine.shutdown()


def test_a_stalled_step_makes_the_engine_unhealthy_not_a_zombie() -> None:
    """A forward pass (or collective) that never returns must fail health checks, so Serve
    replaces the replica instead of keeping one that answers /health but serves nothing."""
    engine = AsyncLLMEngine.from_engine_args(model=MODEL, num_kv_blocks=32)
    engine.client.loop.stall_timeout_s = 0.5  # the watchdog lives with the core loop
    real_execute = engine.engine.executor.execute_model
    release = threading.Event()
    entered = threading.Event()

    def hanging_execute(request):
        entered.set()
        release.wait(30)
        return real_execute(request)

    engine.engine.executor.execute_model = hanging_execute

    async def run() -> None:
        stream = engine.generate("stuck", SamplingParams(max_tokens=2))
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.to_thread(entered.wait, 10)
        engine.check_health()  # a step in progress is not a stall yet
        await asyncio.sleep(0.7)
        with pytest.raises(EngineDeadError, match="stalled"):
            engine.check_health()
        release.set()
        await task
        await stream.aclose()

    try:
        asyncio.run(run())
        engine.check_health()  # the step came back: healthy again
    finally:
        release.set()
        engine.shutdown()


def test_deltas_that_pile_up_merge_into_one_per_choice() -> None:
    from engine.client.async_llm_engine import merge_deltas
    from engine.client.core_messages import RequestDelta
    from engine.outputs import Logprob

    def lp(token: int) -> dict[int, Logprob]:
        return {token: Logprob(-float(token), 1, str(token))}

    steps = [
        RequestDelta("r", [ChoiceDelta(0, "a", [1], [lp(1)], None, None, 1, -1.0),
                           ChoiceDelta(1, "", [7], [lp(7)], None, None, 1, -7.0)], False),
        RequestDelta("r", [ChoiceDelta(1, "xy", [8], [lp(8)], "stop", "y", 2, -15.0)], False),
        RequestDelta("r", [ChoiceDelta(0, "b", [2], [lp(2)], "length", None, 2, -3.0)], True, 4),
    ]  # fmt: skip
    merged = merge_deltas(steps)
    assert merged.finished and merged.num_cached_tokens == 4
    first, second = merged.choices
    assert (first.text, first.token_ids, first.finish_reason, first.num_tokens) == (
        "ab",
        [1, 2],
        "length",
        2,
    )
    assert first.logprobs == [lp(1), lp(2)] and first.cumulative_logprob == -3.0
    assert (second.text, second.token_ids, second.finish_reason, second.stop_reason) == (
        "xy",
        [7, 8],
        "stop",
        "y",
    )
