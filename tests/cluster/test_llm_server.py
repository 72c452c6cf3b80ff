"""LLMServer without Ray: its stream starts with a "start" item or a validation error, and its
health reflects the engine (Serve replaces a replica whose check_health raises)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.llm_server import LLMServer
from engine import LLM, EngineDeadError, SamplingParams

ENGINE_ARGS = {"model": "builtin:tiny-llama", "num_kv_blocks": 64, "device": "cpu"}


@pytest.fixture(scope="module")
def server() -> Iterator[LLMServer]:
    server = LLMServer("tiny", ENGINE_ARGS)
    yield server
    server.engine.shutdown()


def collect(server: LLMServer, request: dict[str, Any]) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [item async for item in server.generate(request)]

    return asyncio.run(run())


def test_stream_is_start_then_deltas_matching_offline(server: LLMServer) -> None:
    params = {"temperature": 0, "max_tokens": 12}
    items = collect(server, {"prompt": "Once upon", "params": params})
    offline = LLM(**ENGINE_ARGS).generate("Once upon", SamplingParams(**params), use_tqdm=False)
    assert items[0] == {"type": "start", "prompt_tokens": len(offline[0].prompt_token_ids)}
    assert "".join(i["text"] for i in items[1:]) == offline[0].outputs[0].text
    assert items[-1]["finish_reason"] == "length"
    assert items[-1]["num_output_tokens"] == 12


def test_invalid_params_are_the_first_and_only_item(server: LLMServer) -> None:
    items = collect(server, {"prompt": "x", "params": {"top_p": 2.0}})
    assert len(items) == 1
    assert (items[0]["type"], items[0]["status"], items[0]["param"]) == ("error", 400, "top_p")


def test_unknown_sampling_parameter_is_rejected(server: LLMServer) -> None:
    items = collect(server, {"prompt": "x", "params": {"beam_width": 2}})
    assert (items[0]["status"], items[0]["param"]) == (400, "beam_width")


def test_dead_engine_fails_health_and_requests() -> None:
    server = LLMServer("tiny", ENGINE_ARGS)
    executor = server.engine.engine.executor

    def broken(request: Any) -> Any:
        raise EngineDeadError("worker 0 died")

    executor.execute_model = broken
    try:
        first = collect(server, {"prompt": "x", "params": {"max_tokens": 4}})
        assert first[-1]["type"] == "error" and first[-1]["status"] == 503
        with pytest.raises(EngineDeadError):
            server.check_health()
        assert asyncio.run(server.health())["healthy"] is False
        after = collect(server, {"prompt": "x", "params": {"max_tokens": 4}})
        assert (after[0]["type"], after[0]["status"]) == ("error", 503)
    finally:
        server.engine.shutdown()
