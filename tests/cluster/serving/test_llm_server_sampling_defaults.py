"""The model's sampling defaults on the served path: a chat request that leaves ``temperature``
and ``max_tokens`` unset, as the API sends it (``openai_payloads.chat_payload``), samples with
the checkpoint's ``generation_config.json`` values on the replica (``LLMServer``), as vLLM's
server does; a given value wins; a default ``max_tokens`` fits what the prompt leaves of the
context. The checkpoint: tiny-llama, greedy and 5 tokens by its generation_config."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.api.openai_models import ChatCompletionRequest
from cluster.api.openai_payloads import chat_payload
from cluster.api.replica_messages import GenerateRequest, StreamError, StreamStart
from cluster.serving.llm_server import LLMServer
from tests.cluster.api.test_reasoning_chat import MESSAGES, serve_chat
from tests.engine.test_generation_defaults import greedy_checkpoint

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLMServer]:
    path = greedy_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("greedy"))
    server = LLMServer("g", {"model": str(path), "num_kv_blocks": 32, "device": "cpu",
                             "max_model_len": MAX_MODEL_LEN})  # fmt: skip
    yield server
    server.engine.shutdown()


def _chat(**fields: Any) -> GenerateRequest:
    body = {"model": "g", "messages": MESSAGES, **fields}
    return chat_payload(ChatCompletionRequest.model_validate(body))


def _start(server: LLMServer, request: GenerateRequest) -> StreamStart:
    async def first() -> StreamStart:
        stream = server.generate(request)
        item = await stream.__anext__()
        await stream.aclose()
        assert isinstance(item, StreamStart), item
        return item

    return asyncio.run(first())


def test_an_unset_temperature_and_max_tokens_take_the_models_values(server: LLMServer) -> None:
    by_default, _ = serve_chat(server, _chat(), stream=False)
    greedy, _ = serve_chat(server, _chat(temperature=0, max_tokens=5), stream=False)
    answer = by_default.whole()
    assert answer["choices"][0]["message"] == greedy.whole()["choices"][0]["message"]
    assert answer["usage"]["completion_tokens"] == greedy.whole()["usage"]["completion_tokens"]
    assert answer["usage"]["completion_tokens"] <= 5
    start = _start(server, _chat(temperature=None))
    assert (start.temperature, start.top_p) == (0.0, 1.0)


def test_a_given_value_wins_even_at_openais_default(server: LLMServer) -> None:
    start = _start(server, _chat(temperature=1.0, top_p=0.5))
    assert (start.temperature, start.top_p) == (1.0, 0.5)
    many, _ = serve_chat(server, _chat(max_tokens=9, ignore_eos=True), stream=False)
    assert many.whole()["usage"]["completion_tokens"] == 9


def test_a_default_max_tokens_fits_what_the_prompt_leaves(server: LLMServer) -> None:
    """5 by default, 2 where the prompt leaves room for only 2 (not a 400, as vLLM)."""
    ids = list(range(10, 10 + MAX_MODEL_LEN - 2))
    request = GenerateRequest(prompt_token_ids=ids, params={"ignore_eos": True})
    completion, _ = serve_chat(server, request, stream=False)
    assert completion.whole()["usage"]["completion_tokens"] == 2
    short = GenerateRequest(prompt_token_ids=ids[:8], params={"ignore_eos": True})
    completion, _ = serve_chat(server, short, stream=False)
    assert completion.whole()["usage"]["completion_tokens"] == 5
    refused = GenerateRequest(prompt_token_ids=ids + [1, 2, 3], params={})

    async def error() -> Any:
        return await server.generate(refused).__anext__()

    assert isinstance(asyncio.run(error()), StreamError)  # too long: the engine's 400 as before
