"""Fuzzing the OpenAI API: whatever a client sends, no response is a 5xx, every error has
OpenAI's error body (Anthropic's on its Messages routes), and the server keeps serving (healthy,
answering, no request state left).

- Schemathesis generates requests from the ingress's own OpenAPI schema, valid ("positive") and
  invalid ("negative"), with the API key and (a smaller pass) without it. Half the valid
  generation requests are nudged past the checks a schema cannot state, so they reach the
  engine rather than stop at a 400.
- A sweep puts each of a few nasty values (ints past 64 bits, lone surrogates, ...) into each
  field of an otherwise valid request: values a schema-driven generator almost never draws,
  and the ones that found the bugs this test guards against.

The routes are the real ones (``OpenAIIngress`` over ``make_openai_app``, with the API-key guard
on) and so is the model server (an ``LLMServer`` on the tiny Llama); only Serve's deployment
handles are replaced by in-process calls, so no Ray is needed. Each step message makes the
msgpack round trip a Ray worker's would, so a request the wire cannot carry fails here too.
``max_model_len`` 64 and ``max_n`` 4 keep every generation short.

Hypothesis drives each operation's strategy directly (schemathesis's pytest loader does not run
under this pytest): derandomized, so CI sees the same cases every run, and without shrinking,
so a failure is reported at once with the case that caused it.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from cluster.api.anthropic_models import CountTokensRequest, MessagesRequest
from cluster.api.api_guard import OPEN_PATHS
from cluster.api.media import MediaSettings
from cluster.api.openai_api import make_openai_app
from cluster.api.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from cluster.api.pooling_models import ClassificationRequest, RerankRequest, ScoreRequest
from cluster.api.responses_models import ResponsesRequest
from cluster.serving.ingress import OpenAIIngress
from cluster.serving.llm_server import LLMServer
from cluster.serving.token_channel import TokenChannel
from engine.worker.step_messages import decode_request, encode

MODEL = "tiny-llama"
KEY = "sk-fuzz"
AUTH = {"authorization": f"Bearer {KEY}"}
ENGINE_ARGS = {"model": "builtin:tiny-llama", "num_kv_blocks": 64, "device": "cpu",
               "max_model_len": 64, "max_n": 4}  # fmt: skip
# Per operation and generation mode. The module takes ~25 s of CPU (~12 s of it this pass).
EXAMPLES = 40
UNAUTHENTICATED_EXAMPLES = 5
ERROR_FIELDS = {"message", "type", "param", "code"}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
# Routes that answer in Anthropic's error shape and name each SSE event.
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Valid by the schema, but a 400 by design (see openai_api): nudged cases leave them out.
_UNSUPPORTED = ("suffix", "best_of", "chat_template")
# Values a schema-driven generator rarely or never draws (hypothesis's text has no surrogates)
# and that once hung, killed or 500ed the server: ints past 64 bits (torch, msgpack, int64
# tensors; a huge n), lone surrogates (tokenizer, prefix-cache hash, UTF-8 bodies), digits that
# int() does not parse. The sweep puts each in each field of a request that is otherwise valid.
NASTY = (2**64, -(2**64) - 1, 10**30, 1e308, -1e308, "", "\ud800", "²", "9" * 5000,
         [2**64], ["ok", "\udfff"], [[2**64]], {"²": 1.0}, {"\ud800": 1.0})  # fmt: skip
VALID_BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 2},
    "/tokenize": {"model": MODEL, "prompt": "Hi"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
    "/v1/embeddings": {"model": MODEL, "input": ["Hi", [1, 2]]},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL, "max_tokens": 2,
                     "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/messages/count_tokens": {"model": MODEL,
                                  "messages": [{"role": "user", "content": "Hi"}]},
}  # fmt: skip


_closing: set[asyncio.Future[Any]] = set()


class _LocalStream:
    """What ``handle.options(stream=True).generate.remote()`` returns, over a local generator."""

    def __init__(self, items: AsyncIterator[dict[str, Any]]) -> None:
        self.items = items

    def __aiter__(self) -> _LocalStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self.items.__anext__()

    def cancel(self) -> None:
        # Closing the server's generator aborts its request (as Serve's cancel does).
        task = asyncio.ensure_future(self.items.aclose())  # type: ignore[attr-defined]
        _closing.add(task)
        task.add_done_callback(_closing.discard)


class _Method:
    def __init__(self, fn: Any, stream: bool = False) -> None:
        self.fn, self.stream = fn, stream

    def remote(self, *args: Any) -> Any:
        return _LocalStream(self.fn(*args)) if self.stream else self.fn(*args)


class _LocalHandle:
    """A deployment handle that calls an in-process ``LLMServer``."""

    def __init__(self, server: LLMServer, stream: bool = False) -> None:
        self.server, self._stream = server, stream

    def options(self, stream: bool = False, **_: Any) -> _LocalHandle:
        return _LocalHandle(self.server, stream)

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.server, name), self._stream and name == "generate")

    def broadcast(self, method: str, *args: Any) -> _Broadcast:
        return _Broadcast(getattr(self.server, method), args)


class _Broadcast:
    """``handle.broadcast(...)`` over the one local replica."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    async def results_async(self) -> list[Any]:
        result = self.fn(*self.args)
        return [await result if inspect.isawaitable(result) else result]


@pytest.fixture(scope="module")
def server() -> Iterator[LLMServer]:
    server = LLMServer(MODEL, ENGINE_ARGS)
    executor = server.engine.engine.executor
    execute_model = executor.execute_model

    def over_the_wire(request: Any) -> Any:
        # As RayExecutor sends it: a request whose ints overflow msgpack fails here too.
        return execute_model(decode_request(encode(request)))

    executor.execute_model = over_the_wire  # type: ignore[method-assign]
    yield server
    server.engine.shutdown()


@pytest.fixture(scope="module")
def app(server: LLMServer) -> Any:
    ingress = object.__new__(OpenAIIngress)
    ingress.servers = {MODEL: _LocalHandle(server)}
    ingress.lora_models = set()
    ingress.cold_start_timeouts = {}
    ingress.prefill = {}  # no disaggregated model
    ingress.awake = None  # no sleep_mode
    ingress.media = MediaSettings()  # no remote images
    ingress.api_key_hashes = [hashlib.sha256(KEY.encode()).hexdigest()]
    ingress.max_body_bytes = 1 << 16
    ingress._stopping = None  # not a Serve replica: never stopping
    ingress.channel = TokenChannel()  # unused: the local server has no head actor

    async def no_metrics() -> Any:
        return "metrics are scraped from Ray, which this test does not run"

    ingress.metrics = no_metrics  # type: ignore[method-assign]
    return make_openai_app(ingress, ingress.api_key_hashes, ingress.max_body_bytes)


@pytest.fixture(scope="module")
def api_schema(app: Any) -> Any:
    # The schema route is behind the key like every route but the probes' /health and /livez.
    return schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)


def _fuzz(api_schema: Any, check: Callable[[Any], None], max_examples: int) -> list[str]:
    """Run ``check`` on ``max_examples`` cases per operation and generation mode (negative
    cases only where there is an input to break); returns the operations fuzzed."""
    fuzz_settings = settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    fuzzed = []
    for result in api_schema.get_all_operations():
        operation = result.ok()
        modes = [GenerationMode.POSITIVE]
        if operation.body:
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            cases = operation.as_strategy(generation_mode=mode).map(_for_the_model)
            if mode == GenerationMode.POSITIVE:
                cases = _with_nudged(cases, operation.path)
            fuzz_settings(given(case=cases)(check))()
        fuzzed.append(f"{operation.method.upper()} {operation.path}")
    return fuzzed


def _with_nudged(cases: Any, path: str) -> Any:
    """Positive generation cases as drawn and nudged, in equal shares."""
    return st.one_of(cases, cases.map(_nudged)) if path in GENERATION_PATHS else cases


def _for_the_model(case: Any) -> Any:
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL  # reach the model server, not only the 404
    return case


def _nudged(case: Any) -> Any:
    """A case past the checks a schema cannot state (one prompt, text messages that the chat
    template takes, no unsupported fields, stream_options only when streaming), so that half the
    positive generation cases reach the engine with whatever sampling fields were drawn."""
    body = case.body
    if not isinstance(body, dict):
        return case
    for name in _UNSUPPORTED:
        body.pop(name, None)
    if "stream_options" in body:
        body["stream"] = True
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[0]
    if "prompt" in body and not body["prompt"]:
        body["prompt"] = "x"
    if isinstance(body.get("messages"), list):
        texts = [m.get("content") for m in body["messages"]]
        body["messages"] = [
            {"role": m["role"], "content": text if isinstance(text, str) else ""}
            for m, text in zip(body["messages"][:2], texts)
        ]
    return case


def _describe(case: Any, response: Any) -> str:
    return f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text!r}"


def _is_json(response: Any) -> bool:
    # Schemathesis keeps every value of a header, as a list.
    return any(v.startswith("application/json") for v in response.headers.get("content-type", []))


def _check_error_body(case: Any, response: Any) -> None:
    assert _is_json(response), _describe(case, response)
    assert _is_error_body(case.path, response.json()), _describe(case, response)


def _is_error_body(path: str, body: dict[str, Any]) -> bool:
    """OpenAI's error body, or Anthropic's on its routes."""
    error = body.get("error")
    if not isinstance(error, dict):
        return False
    if path in ANTHROPIC_PATHS:
        fields_ok = body.get("type") == "error" and set(error) == {"type", "message"}
    else:
        fields_ok = set(error) == ERROR_FIELDS
    return fields_ok and isinstance(error["message"], str) and isinstance(error["type"], str)


def _check_event_stream(case: Any, response: Any) -> None:
    """Every event is a JSON chunk (an error one with OpenAI's error body), and a stream that
    schemathesis read to its end ends with [DONE]. A Responses or Messages stream names each
    event's type (``event: <type>``, its data's ``type``) and ends with a final response event
    (``message_stop``, or an ``error``) instead."""
    events = [e for e in response.content.decode().split("\n\n") if e]
    responses = case.path in ("/v1/responses", "/v1/messages")
    for event in events:
        if responses:
            kind, _, event = event.partition("\n")
            assert kind.startswith("event: "), _describe(case, response)
            assert json.loads(event.removeprefix("data: "))["type"] == kind.removeprefix("event: ")
        assert event.startswith("data: "), _describe(case, response)
        data = event.removeprefix("data: ")
        if data != "[DONE]" and "error" in (chunk := json.loads(data)):
            assert _is_error_body(case.path, chunk), _describe(case, response)
    if response.stream_cut_short:
        return
    if responses:
        last = json.loads(events[-1].partition("\n")[2].removeprefix("data: "))["type"]
        finals = ("response.completed", "response.incomplete", "response.failed")
        if case.path in ANTHROPIC_PATHS:
            finals = ("message_stop", "error")
        assert last in finals, _describe(case, response)
    else:
        assert events and events[-1] == "data: [DONE]", _describe(case, response)


def _call_authenticated(case: Any) -> None:
    response = case.call(headers=AUTH)
    assert response.status_code < 500, _describe(case, response)
    if response.status_code >= 400:
        _check_error_body(case, response)
    elif _is_json(response):
        response.json()  # a 200 body is JSON that parses (no NaN, no lone surrogate)
    elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        _check_event_stream(case, response)


def _call_unauthenticated(case: Any) -> None:
    response = case.call()
    if case.path in OPEN_PATHS:  # the probes and /version need no key
        assert response.status_code == 200, _describe(case, response)
        return
    assert response.status_code == 401, _describe(case, response)
    _check_error_body(case, response)


def _assert_no_request_state_left(server: LLMServer, timeout_s: float = 10.0) -> None:
    # Cancelled streams abort their requests asynchronously: give them a moment.
    deadline = time.monotonic() + timeout_s
    while True:
        state = asyncio.run(server.request_state())
        counts = {**state["head"], **{f"worker{i}": n for i, n in enumerate(state["workers"])}}
        if not any(counts.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(counts.values()), counts
    assert state["kv_free_blocks"] == state["kv_total_blocks"]


def test_schema_request_bodies_are_the_request_models(api_schema: Any, app: Any) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    raw = app.openapi()
    # Every route, as schemathesis reads the schema.
    assert len(operations) == sum(len(ops) for ops in raw["paths"].values())
    bodies = {
        path: ops["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        for path, ops in raw["paths"].items()
        if "post" in ops and "requestBody" in ops["post"]
    }
    # Sleep mode's admin routes take query parameters (vLLM's), no body; /ping (= /health) none.
    bodiless = {path for path, ops in raw["paths"].items() if "post" in ops} - set(bodies)
    assert bodiless == {"/sleep", "/wake_up", "/ping"}
    assert bodies == {
        "/v1/completions": "#/components/schemas/CompletionRequest",
        "/v1/chat/completions": "#/components/schemas/ChatCompletionRequest",
        "/tokenize": "#/components/schemas/TokenizeRequest",
        "/detokenize": "#/components/schemas/DetokenizeRequest",
        "/v1/embeddings": "#/components/schemas/EmbeddingRequest",
        "/v1/responses": "#/components/schemas/ResponsesRequest",
        "/classify": "#/components/schemas/ClassificationRequest",
        **dict.fromkeys(("/score", "/v1/score"), "#/components/schemas/ScoreRequest"),
        **dict.fromkeys(
            ("/rerank", "/v1/rerank", "/v2/rerank"), "#/components/schemas/RerankRequest"
        ),
        "/v1/messages": "#/components/schemas/MessagesRequest",
        "/v1/messages/count_tokens": "#/components/schemas/CountTokensRequest",
    }
    models = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
              EmbeddingRequest, ResponsesRequest, ClassificationRequest, ScoreRequest,
              RerankRequest, MessagesRequest, CountTokensRequest)  # fmt: skip
    for model in models:
        component = raw["components"]["schemas"][model.__name__]
        assert set(component["properties"]) == set(model.model_fields)
        # Unknown fields are accepted (harmless ones ignored, output-changing ones a 400).
        assert component.get("additionalProperties", True) is True


@pytest.mark.slow
def test_fuzzed_requests_with_the_key_get_no_server_error(
    api_schema: Any, app: Any, server: LLMServer
) -> None:
    fuzzed = _fuzz(api_schema, _call_authenticated, EXAMPLES)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
            "POST /detokenize", "GET /v1/models", "GET /health", "GET /livez",
            "POST /v1/embeddings",
            "GET /v1/models/{model_id}", "POST /v1/responses",
            "GET /v1/responses/{response_id}", "POST /v1/messages",
            "POST /v1/messages/count_tokens"} <= set(fuzzed)  # fmt: skip
    # Still serving: the engine is alive, answers a plain request, and holds nothing.
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "ok"}
        body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "temperature": 0}
        response = client.post("/v1/completions", json=body, headers=AUTH)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "length"
    _assert_no_request_state_left(server)


@pytest.mark.slow
def test_fuzzed_requests_without_the_key_are_401(api_schema: Any) -> None:
    _fuzz(api_schema, _call_unauthenticated, UNAUTHENTICATED_EXAMPLES)


def _spiked_bodies(app: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every valid body with one field (every field the schema has; a chat message's content)
    set to each nasty value, generation requests streamed and not."""
    schemas = app.openapi()["components"]["schemas"]
    for path, valid in VALID_BODIES.items():
        ref = app.openapi()["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        fields = list(schemas[ref["schema"]["$ref"].rsplit("/", 1)[1]]["properties"])
        streams = (False, True) if path in GENERATION_PATHS else (False,)
        for field, value, stream in itertools.product(fields, NASTY, streams):
            body = {**valid, field: value} | ({"stream": True} if stream else {})
            yield path, body
        if "messages" in valid:
            for value in NASTY:
                yield path, {**valid, "messages": [{"role": "user", "content": value}]}


@pytest.mark.slow
def test_nasty_value_in_any_field_gets_no_server_error(app: Any, server: LLMServer) -> None:
    with TestClient(app) as client:
        for path, body in _spiked_bodies(app):
            # ASCII JSON: a lone surrogate travels as its escape, as any client would send it.
            content = json.dumps(body).encode()
            headers = {**AUTH, "content-type": "application/json"}
            response = client.post(path, content=content, headers=headers)
            assert response.status_code < 500, f"{path} {body!r}: {response.text}"
            if response.status_code >= 400:
                assert _is_error_body(path, response.json()), response.text
        assert client.get("/health").json() == {"status": "ok"}
    _assert_no_request_state_left(server)
