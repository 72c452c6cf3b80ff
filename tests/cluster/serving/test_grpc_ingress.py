"""The gRPC servicer (``cluster.serving.grpc_ingress``) called directly, with a recording context
and fake model handles: no Ray, no server. Its rules are the HTTP edge's (``api_guard``)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from cluster.api.api_errors import APIError
from cluster.api.api_guard import _authorized
from cluster.api.replica_messages import GenerateRequest, StreamDelta, StreamError, StreamStart
from cluster.proto import llm_pb2
from cluster.serving.grpc_ingress import LLMServicer, grpc_check_key
from cluster.serving.ingress import OpenAIIngress
from engine.client.core_messages import ChoiceDelta

KEY = "sk-grpc-test"
KEY_HASHES = [hashlib.sha256(KEY.encode()).hexdigest()]


class Context:
    """What the servicer uses of Serve's ``RayServegRPCContext``."""

    def __init__(self, metadata: list[tuple[str, str]] = ()):
        self.metadata = list(metadata)
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: dict[str, str] = {}

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = dict(metadata)


class Items:
    """A server stream: its items, then the end; records ``cancel``."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        for item in self.items:
            yield item

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """A model's deployment handle: ``health`` answers ``healthy``."""

    def __init__(self, healthy: bool = True) -> None:
        self.healthy = healthy
        self.health = self

    def remote(self) -> Any:
        async def answer() -> dict[str, Any]:
            return {"healthy": self.healthy, "error": "engine dead"}

        return answer()

    def options(self, **_: Any) -> Handle:
        return self


class Ingress(LLMServicer):
    """The servicer as ``OpenAIIngress`` mixes it in, with the ingress's own routing."""

    _route = OpenAIIngress._route
    _server = OpenAIIngress._server

    def __init__(
        self,
        key_hashes: list[str] = (),
        max_body_bytes: int = 1 << 20,
        items: list[Any] | None = None,
        fails: Exception | None = None,
    ) -> None:
        self.api_key_hashes = list(key_hashes)
        self.max_body_bytes = max_body_bytes
        self.servers = {"m": Handle(), "sick": Handle(healthy=False)}
        self.lora_models = {"m"}
        self.cold_start_timeouts = {}
        self.opened: list[GenerateRequest] = []
        self.stream = Items(items if items is not None else [delta("hi", "stop")])
        self.fails = fails

    async def open_stream(self, model: str, payload: GenerateRequest) -> tuple[StreamStart, Any]:
        self.opened.append(payload)
        if self.fails is not None:
            raise self.fails
        return StreamStart(prompt_tokens=3), self.stream


def delta(text: str, finish_reason: str | None = None) -> StreamDelta:
    return StreamDelta([ChoiceDelta(0, text, [7], None, finish_reason, None, 1)])


def generate(
    ingress: Ingress, request: llm_pb2.GenerateRequest, context: Context
) -> list[llm_pb2.GenerateResponse]:
    async def collect() -> list[llm_pb2.GenerateResponse]:
        return [r async for r in ingress.Generate(request, context)]  # type: ignore[arg-type]

    return asyncio.run(collect())


def health(ingress: Ingress, model: str, context: Context) -> llm_pb2.HealthResponse:
    request = llm_pb2.HealthRequest(model=model)
    return asyncio.run(ingress.Health(request, context))  # type: ignore[arg-type]


def refused(call: Any, *args: Any) -> Context:
    """Run ``call``, which must fail with a status; the context it set."""
    context = next(a for a in args if isinstance(a, Context))
    with pytest.raises(APIError):
        call(*args)
    assert context.code is not None
    return context


REQUEST = llm_pb2.GenerateRequest(model="m", prompt="hello")


# ---- API keys: HTTP's rule, one parser -------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "accepted"),
    [
        ([("authorization", f"Bearer {KEY}")], True),
        ([("authorization", f"bearer {KEY}")], True),
        ([("authorization", f"BEARER {KEY}")], True),
        ([("authorization", KEY)], False),  # a bare key: no scheme, no key
        ([("authorization", "Basic dXNlcjpwdw=="), ("x-api-key", KEY)], True),
        ([("x-api-key", KEY)], True),
        ([("authorization", "Bearer"), ("x-api-key", KEY)], True),
        ([("authorization", "Bearer sk-wrong")], False),
        ([], False),
    ],
)
def test_grpc_accepts_exactly_the_keys_http_accepts(
    metadata: list[tuple[str, str]], accepted: bool
) -> None:
    scope = {"headers": [(k.encode(), v.encode()) for k, v in metadata]}
    assert _authorized(scope, KEY_HASHES) is accepted  # type: ignore[arg-type]
    context = Context(metadata)
    if accepted:
        grpc_check_key(context, KEY_HASHES)  # type: ignore[arg-type]
        assert context.code is None
    else:
        refused(grpc_check_key, context, KEY_HASHES)
        assert context.code == grpc.StatusCode.UNAUTHENTICATED


def test_generate_without_a_key_is_unauthenticated_before_the_model_is_asked() -> None:
    ingress = Ingress(KEY_HASHES)
    context = refused(generate, ingress, REQUEST, Context())
    assert context.code == grpc.StatusCode.UNAUTHENTICATED
    assert not ingress.opened


def test_health_needs_no_api_key_like_http_health() -> None:
    response = health(Ingress(KEY_HASHES), "m", Context())
    assert (response.healthy, response.message) == (True, "ok")


# ---- Health ----------------------------------------------------------------------------------


def test_health_of_a_lora_adapter_is_its_base_model_s() -> None:
    assert health(Ingress(), "m:my-adapter", Context()).healthy


def test_health_of_an_unknown_model_is_not_found_naming_it() -> None:
    context = refused(health, Ingress(), "nope", Context())
    assert context.code == grpc.StatusCode.NOT_FOUND
    assert "nope" in context.details


def test_health_of_a_dead_engine_is_unavailable_naming_the_model() -> None:
    context = refused(health, Ingress(), "sick", Context())
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert context.details == "sick: engine dead"


# ---- Generate: the request's shape and size ----------------------------------------------------


def test_generate_streams_the_model_s_deltas_and_cancels_the_stream_at_the_end() -> None:
    ingress = Ingress()
    responses = generate(ingress, REQUEST, Context())
    assert [(r.text, list(r.token_ids), r.finish_reason) for r in responses] == [
        ("hi", [7], "stop")
    ]
    assert responses[0].prompt_tokens == 3
    assert ingress.stream.cancelled


def test_a_request_over_max_body_bytes_is_resource_exhausted_before_any_work() -> None:
    ingress = Ingress(max_body_bytes=1000)
    request = llm_pb2.GenerateRequest(model="m", prompt="x" * 1000)
    context = refused(generate, ingress, request, Context())
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_body_bytes" in context.details
    assert not ingress.opened


def test_an_overloaded_model_is_resource_exhausted_with_a_retry_after() -> None:
    """HTTP's 503 overloaded carries ``Retry-After``; gRPC carries it as trailing metadata."""
    overloaded = APIError(503, "model 'm' is overloaded, retry later", None, "overloaded",
                          retry_after=1)  # fmt: skip
    context = refused(generate, Ingress(fails=overloaded), REQUEST, Context())
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert context.trailing == {"retry-after": "1"}
    invalid = APIError(400, "temperature: must be ...", "temperature")
    assert refused(generate, Ingress(fails=invalid), REQUEST, Context()).trailing == {}


def test_a_request_at_max_body_bytes_is_served() -> None:
    request = llm_pb2.GenerateRequest(model="m", prompt="x" * 100)
    ingress = Ingress(max_body_bytes=request.ByteSize())
    assert generate(ingress, request, Context())


@pytest.mark.parametrize(
    ("fields", "details"),
    [
        ({"model": "m", "prompt": ""}, "prompt: must not be empty"),
        ({"model": "", "prompt": "hi"}, "model: required"),
        ({"model": "m", "prompt": "hi", "prompt_token_ids": [1]}, "prompt: give exactly one"),
    ],
)
def test_a_missing_prompt_or_model_is_invalid_argument_naming_it(
    fields: dict[str, Any], details: str
) -> None:
    ingress = Ingress()
    context = refused(generate, ingress, llm_pb2.GenerateRequest(**fields), Context())
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith(details)
    assert not ingress.opened


# ---- Generate: errors carry no internals ------------------------------------------------------


def test_an_unexpected_error_is_internal_without_its_text_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ingress = Ingress(fails=RuntimeError("secret /srv/llm/config.yaml"))
    context = Context()
    logged = caplog.at_level(logging.ERROR, logger="llm_cluster.serve")
    with logged, pytest.raises(APIError) as info:
        generate(ingress, REQUEST, context)
    assert (context.code, context.details) == (grpc.StatusCode.INTERNAL, "internal server error")
    assert "secret" not in str(info.value) and info.value.__cause__ is None
    assert info.value.__suppress_context__
    assert "secret /srv/llm/config.yaml" in caplog.text


def test_an_error_of_the_model_mid_stream_keeps_its_status() -> None:
    ingress = Ingress(items=[delta("a"), StreamError(503, "engine dead", None, "engine_dead")])
    context = Context()
    with pytest.raises(APIError):
        generate(ingress, REQUEST, context)
    assert (context.code, context.details) == (grpc.StatusCode.UNAVAILABLE, "engine dead")
    assert ingress.stream.cancelled


# ---- Generate: timeouts ----------------------------------------------------------------------


def test_x_request_timeout_metadata_is_the_engine_s_timeout() -> None:
    ingress = Ingress()
    generate(ingress, REQUEST, Context([("x-request-timeout", "2.5")]))
    assert ingress.opened[0].timeout == 2.5


def test_without_x_request_timeout_the_engine_has_none() -> None:
    ingress = Ingress()
    generate(ingress, REQUEST, Context())
    assert ingress.opened[0].timeout is None


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "inf"])
def test_a_bad_x_request_timeout_is_invalid_argument_naming_it(raw: str) -> None:
    context = refused(generate, Ingress(), REQUEST, Context([("x-request-timeout", raw)]))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith("x-request-timeout: ")


def test_the_engine_s_timeout_firing_is_deadline_exceeded() -> None:
    ingress = Ingress(items=[StreamError(408, "the request's timeout (2.5 s) passed", "timeout")])
    context = refused(generate, ingress, REQUEST, Context([("x-request-timeout", "2.5")]))
    assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED
