"""A replica that starts asleep (``start_asleep``: a model beyond ``sleep_mode.max_awake_models``)
without Ray: no engine until its first wake, which a request triggers; the tokens are those of
the engine started at once; requests share one start, also past a wake timeout; a start that
fails is a 503 and the next request starts it again."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from cluster.api.replica_messages import GenerateRequest
from cluster.serving.llm_server import LLMServer
from engine import LLM, SamplingParams

ENGINE_ARGS = {"model": "builtin:tiny-llama", "num_kv_blocks": 64, "device": "cpu"}
SLEEP = {"level": 1, "wake_timeout_s": 120}
PROMPT = "The capital of France is"


def _request(max_tokens: int = 6) -> GenerateRequest:
    return GenerateRequest(prompt=PROMPT, params={"max_tokens": max_tokens, "temperature": 0})


async def _tokens(server: LLMServer, max_tokens: int = 6) -> list[Any]:
    items = [item async for item in server.generate(_request(max_tokens))]
    errors = [i for i in items if type(i).__name__ == "StreamError"]
    if errors:
        return errors
    return [t for i in items[1:] for c in i.choices for t in c.token_ids]


@pytest.fixture
def asleep() -> Any:
    server = LLMServer("tiny", ENGINE_ARGS, sleep_config=SLEEP, start_asleep=True)
    yield server
    if server.engine is not None:
        server.engine.shutdown()


def test_it_holds_no_engine_and_reports_level_2_until_a_request_wakes_it(asleep: Any) -> None:
    assert asleep.engine is None
    assert asyncio.run(asleep.is_sleeping()) is True
    assert asleep.sleep_state()["sleep_level"] == 2
    assert asyncio.run(asleep.stats())["kv_total_blocks"] == 0
    assert asyncio.run(asleep.health()) == {"healthy": True}
    state = asyncio.run(asleep.request_state())
    assert state["kv_total_blocks"] == 0 and not state["workers"]

    tokens = asyncio.run(_tokens(asleep))
    expected = LLM(**ENGINE_ARGS).generate([PROMPT], SamplingParams(max_tokens=6, temperature=0))
    assert tokens == list(expected[0].outputs[0].token_ids)
    assert asleep.engine is not None and asleep.sleep_level is None
    assert asyncio.run(asleep.stats())["kv_total_blocks"] == 64
    # From here it sleeps and wakes like any replica, with the same tokens.
    assert asyncio.run(asleep.sleep(1))["sleep_level"] == 1
    assert asyncio.run(_tokens(asleep)) == tokens


def test_requests_share_one_start_even_past_a_wake_timeout(asleep: Any, monkeypatch: Any) -> None:
    starts = []
    start = asleep._start_core

    def slow() -> None:
        starts.append(1)
        time.sleep(1.0)
        start()

    monkeypatch.setattr(asleep, "_start_core", slow)

    async def scenario() -> tuple[list[Any], list[Any], list[Any]]:
        asleep._wake_timeout_s = 0.3
        timed_out = await _tokens(asleep)  # the start goes on after this request gives up
        asleep._wake_timeout_s = 120
        return timed_out, *await asyncio.gather(_tokens(asleep), _tokens(asleep, 3))

    timed_out, first, second = asyncio.run(scenario())
    assert timed_out[0].status == 503
    assert starts == [1] and second == first[:3] and len(first) == 6


def test_a_failed_start_is_a_503_and_the_next_request_starts_it(
    asleep: Any, monkeypatch: Any
) -> None:
    start = asleep._start_core

    def fails_once() -> None:
        monkeypatch.setattr(asleep, "_start_core", start)
        raise RuntimeError("the head could not be placed")

    monkeypatch.setattr(asleep, "_start_core", fails_once)
    failed = asyncio.run(_tokens(asleep))
    assert failed[0].status == 503 and "not available" in failed[0].message
    assert asleep.engine is None and asleep.sleep_level == 2
    assert len(asyncio.run(_tokens(asleep))) == 6
    assert asleep.sleep_level is None
