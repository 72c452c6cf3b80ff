"""vLLM's ``truncate_prompt_tokens`` and ``truncation_side``, on the model replica's front
(``LLMServer``, no Ray): a completion, a chat and an embedding are cut to that many of their
prompt's tokens (the last with "left", the first with "right"; unset, vLLM's sides: left for a
generation, right for a pooling input; -1 as many as the model takes, one less for a
generation) and come out as the same request sent with those tokens; bounds are 400s naming the
field. The reference is the tokenizer's own ids, sliced here."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from cluster.api.openai_models import ChatCompletionRequest, CompletionRequest
from cluster.api.openai_payloads import chat_payload, completion_payloads
from cluster.api.replica_messages import (
    EmbedRequest,
    EmbedResult,
    GenerateRequest,
    StreamDelta,
    StreamError,
    StreamStart,
)
from cluster.serving.llm_server import LLMServer

MAX_MODEL_LEN = 128
ARGS = {"num_kv_blocks": 64, "max_model_len": MAX_MODEL_LEN, "device": "cpu"}
TEXT = " ".join(f"item{i}" for i in range(30))
MESSAGES = [{"role": "user", "content": TEXT}]


@pytest.fixture(scope="module")
def server() -> Iterator[LLMServer]:
    server = LLMServer("tiny", {"model": "builtin:tiny-llama", **ARGS})
    yield server
    server.engine.shutdown()


def _run(server: LLMServer, request: GenerateRequest) -> tuple[int, list[int]] | StreamError:
    """The prompt's token count and the greedy output's tokens (or the error)."""

    async def run() -> tuple[int, list[int]] | StreamError:
        prompt_tokens, tokens = 0, []
        async for item in server.generate(request):
            if isinstance(item, StreamError):
                return item
            if isinstance(item, StreamStart):
                prompt_tokens = item.prompt_tokens
            elif isinstance(item, StreamDelta):
                tokens += [t for c in item.choices for t in c.token_ids]
        return prompt_tokens, tokens

    return asyncio.run(run())


GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 4}


def _completion(server: LLMServer, **fields: Any) -> Any:
    [request] = completion_payloads(CompletionRequest(prompt=TEXT, **GREEDY, **fields))
    return _run(server, request)


def _of_ids(server: LLMServer, ids: list[int]) -> tuple[int, list[int]]:
    result = _run(server, GenerateRequest(prompt_token_ids=ids, params=_params()))
    assert not isinstance(result, StreamError), result
    return result


def _params() -> dict[str, Any]:
    [request] = completion_payloads(CompletionRequest(prompt=TEXT, **GREEDY))
    return request.params


@pytest.mark.parametrize("side", ["left", "right", None])
def test_a_completion_is_the_request_of_the_kept_tokens(
    server: LLMServer, side: str | None
) -> None:
    ids = server.tokenizer.encode(TEXT)
    assert len(ids) > 40
    kept = ids[:20] if side == "right" else ids[-20:]  # unset: vLLM's side for generation
    assert _completion(server, truncate_prompt_tokens=20, truncation_side=side) == (
        _of_ids(server, kept)
    )
    assert _completion(server, truncate_prompt_tokens=len(ids) + 5)[0] == len(ids)  # uncut


def test_a_chat_is_cut_after_its_template(server: LLMServer) -> None:
    rendered = server.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    chat = ChatCompletionRequest(messages=MESSAGES, truncate_prompt_tokens=16,
                                 truncation_side="left", **GREEDY)  # fmt: skip
    assert _run(server, chat_payload(chat)) == _of_ids(server, rendered[-16:])


def test_minus_one_keeps_what_a_generation_can_extend(server: LLMServer) -> None:
    long_text = " ".join(f"w{i}" for i in range(200))
    ids = server.tokenizer.encode(long_text)
    assert len(ids) > MAX_MODEL_LEN
    [request] = completion_payloads(CompletionRequest(
        prompt=long_text, truncate_prompt_tokens=-1, truncation_side="left", **GREEDY))  # fmt: skip
    # No cap (a completion's null max_tokens is vLLM's 16; the engine's None): as many as fit.
    request = msgspec.structs.replace(request, params={**request.params, "max_tokens": None})
    prompt_tokens, tokens = _run(server, request)
    assert prompt_tokens == MAX_MODEL_LEN - 1 and len(tokens) == 1  # the context is full


@pytest.mark.parametrize("keep", [MAX_MODEL_LEN + 1, -2])
def test_a_bound_outside_the_model_is_a_400_naming_the_field(server: LLMServer, keep: int) -> None:
    error = _completion(server, truncate_prompt_tokens=keep)
    assert isinstance(error, StreamError)
    assert (error.status, error.param) == (400, "truncate_prompt_tokens")
    assert f"max_model_len {MAX_MODEL_LEN}" in error.message


@pytest.fixture(scope="module")
def embedder() -> Iterator[LLMServer]:
    server = LLMServer(
        "embed", {"model": "builtin:tiny-qwen3-embedding", "runner": "pooling", **ARGS}
    )
    yield server
    server.engine.shutdown()


def test_an_embedding_is_that_of_the_kept_tokens(embedder: LLMServer) -> None:
    ids = embedder.tokenizer.encode(TEXT)

    def embed(request: EmbedRequest) -> EmbedResult:
        result = asyncio.run(embedder.embed(request))
        assert isinstance(result, EmbedResult), result
        return result

    cut = embed(EmbedRequest(prompt=TEXT, truncate_prompt_tokens=12, truncation_side="left"))
    assert cut == embed(EmbedRequest(prompt_token_ids=ids[-12:]))
    assert cut.prompt_tokens == 12
    head = embed(EmbedRequest(prompt=TEXT, truncate_prompt_tokens=12))  # unset: the first
    assert head == embed(EmbedRequest(prompt_token_ids=ids[:12])) != cut
    everything = embed(EmbedRequest(prompt=TEXT, truncate_prompt_tokens=-1))  # fits: uncut
    assert everything == embed(EmbedRequest(prompt=TEXT))
