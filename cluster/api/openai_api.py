"""The OpenAI-compatible HTTP routes over an ``OpenAIServing`` (the Serve ingress implements it).
Request bodies are in ``cluster.api.openai_models``, their mapping to the engine in
``cluster.api.openai_payloads``, responses and SSE in ``cluster.api.openai_responses``, error
bodies in ``cluster.api.api_errors`` and the key / size guard in ``cluster.api.api_guard``.

    POST /v1/completions        POST /v1/chat/completions      GET /v1/models[/{id}]
    POST /v1/embeddings         POST /tokenize                 POST /detokenize
    POST /classify              POST [/v1]/score               POST [/v1|/v2]/rerank
    POST /v1/responses          GET|DELETE /v1/responses/{id}
    POST /v1/messages           POST /v1/messages/count_tokens   (Anthropic's Messages API)
    GET /health (readiness)     GET /livez (liveness)          GET /metrics
    GET|POST /ping (= /health)  GET /version   (vLLM's; no API key, like the probes)
    POST /sleep, POST /wake_up, GET /is_sleeping   (sleep mode, vLLM's; the first two: admin)

Errors are ``{"error": {"message", "type", "param", "code"}}``: 400 invalid input (naming the
field), 401 missing or wrong API key, 404 unknown model or route, 408 the request's ``timeout``
passed, 413 body too large, 431 too many or too large headers, 503 engine dead or overloaded
(the waiting queue is full: with a ``Retry-After`` header). The Anthropic routes answer in
Anthropic's error shape (``{"type": "error", "error": {"type", "message"}}``; overloaded: 529).
Bad input never yields a 500; no error body carries a stack trace, a path or configuration.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Annotated, Any, Protocol

from fastapi import FastAPI, Query, Request
from fastapi.responses import PlainTextResponse

from cluster.api.anthropic_models import CountTokensRequest, MessagesRequest
from cluster.api.api_errors import APIError, install_error_handlers
from cluster.api.api_guard import GuardMiddleware
from cluster.api.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from cluster.api.pooling_models import ClassificationRequest, RerankRequest, ScoreRequest
from cluster.api.responses_models import ResponsesRequest

TIMEOUT_HEADER = "x-request-timeout"
PRIORITY_HEADER = "x-vllm-priority"  # vLLM's
try:
    _VERSION = package_version("llm-cluster")
except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    _VERSION = "unknown"


def with_headers(req: Any, request: Request) -> Any:
    """The request with its headers applied: ``X-Request-Timeout`` (seconds) as ``timeout`` when
    the body sets none (the body's field wins; the server checks the range, > 0), and vLLM's
    ``X-Vllm-Priority`` as ``priority`` on the routes that take one (the header wins, as in
    vLLM; not an int64: a 400 naming it)."""
    update: dict[str, Any] = {}
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is not None and req.timeout is None:
        update["timeout"] = timeout_seconds(raw)
    raw = request.headers.get(PRIORITY_HEADER)
    if raw is not None and "priority" in type(req).model_fields:
        update["priority"] = _header_priority(raw)
    return req.model_copy(update=update) if update else req


def _header_priority(raw: str) -> int:
    try:
        priority = int(raw)
    except ValueError:
        priority = None
    if priority is None or not -(2**63) <= priority < 2**63:
        raise APIError(400, f"{PRIORITY_HEADER}: must be an integer in [-2**63, 2**63 - 1], "
                       f"got {raw[:32]!r}", PRIORITY_HEADER)  # fmt: skip
    return priority


def timeout_seconds(raw: str) -> float:
    """An ``X-Request-Timeout`` value (HTTP header, gRPC metadata) as seconds; a 400 naming it
    unless a finite number > 0."""
    try:
        seconds = float(raw)
    except ValueError:
        raise APIError(400, f"{TIMEOUT_HEADER}: must be a number of seconds, got {raw[:32]!r}",
                       TIMEOUT_HEADER) from None  # fmt: skip
    if not 0 < seconds < float("inf"):
        raise APIError(400, f"{TIMEOUT_HEADER}: must be > 0 seconds, got {raw[:32]!r}",
                       TIMEOUT_HEADER)  # fmt: skip
    return seconds


def metrics_response(text: str) -> PlainTextResponse:
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def new_app(api_key_hashes: Sequence[str] = (), max_body_bytes: int = 1 << 20) -> FastAPI:
    """A FastAPI app with the OpenAI error handlers and the key / body-size guard."""
    app = FastAPI(title="llm-cluster OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.api_key_hashes = list(api_key_hashes)
    app.state.max_body_bytes = max_body_bytes
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware)
    return app


class OpenAIServing(Protocol):
    """What the routes call: the Serve ingress implements it."""

    async def completions(self, req: CompletionRequest) -> Any: ...
    async def chat_completions(self, req: ChatCompletionRequest) -> Any: ...
    async def responses(self, req: ResponsesRequest) -> Any: ...
    async def get_response(self, response_id: str) -> Any: ...
    async def delete_response(self, response_id: str) -> Any: ...
    async def messages(self, req: MessagesRequest) -> Any: ...
    async def count_message_tokens(self, req: CountTokensRequest) -> Any: ...
    async def models(self) -> dict[str, Any]: ...
    async def model(self, model_id: str) -> dict[str, Any]: ...
    async def embeddings(self, req: EmbeddingRequest) -> Any: ...
    async def classify(self, req: ClassificationRequest) -> Any: ...
    async def score(self, req: ScoreRequest) -> Any: ...
    async def rerank(self, req: RerankRequest) -> Any: ...
    async def tokenize(self, req: TokenizeRequest) -> Any: ...
    async def detokenize(self, req: DetokenizeRequest) -> Any: ...
    async def health(self) -> Any: ...
    async def metrics(self) -> Any: ...
    async def sleep(self, model: str | None, level: int) -> Any: ...
    async def wake_up(self, model: str | None, tags: list[str] | None) -> Any: ...
    async def sleep_state(self, model: str | None) -> Any: ...


def make_openai_app(
    serving: OpenAIServing, api_key_hashes: Sequence[str] = (), max_body_bytes: int = 1 << 20
) -> FastAPI:
    """The HTTP routes over ``serving``."""
    app = new_app(api_key_hashes, max_body_bytes)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await serving.completions(with_headers(req, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        return await serving.chat_completions(with_headers(req, request))

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        return await serving.responses(with_headers(req, request))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Any:
        return await serving.get_response(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Any:
        return await serving.delete_response(response_id)

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request) -> Any:
        return await serving.messages(with_headers(req, request))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(req: CountTokensRequest) -> Any:
        return await serving.count_message_tokens(req)

    @app.get("/v1/models")
    async def models() -> Any:
        return await serving.models()

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest) -> Any:
        return await serving.embeddings(req)

    @app.post("/classify")
    async def classify(req: ClassificationRequest) -> Any:
        return await serving.classify(req)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(req: ScoreRequest) -> Any:
        return await serving.score(req)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(req: RerankRequest) -> Any:
        return await serving.rerank(req)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        return await serving.model(model_id)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Any:
        return await serving.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Any:
        return await serving.detokenize(req)

    @app.get("/health")
    @app.get("/ping")  # vLLM's name for it (SageMaker's probe), GET and POST
    @app.post("/ping")
    async def health() -> Any:
        return await serving.health()

    @app.get("/version")
    async def version() -> Any:
        return {"version": _VERSION}

    @app.get("/livez")
    async def livez() -> Any:
        return {"status": "ok"}  # liveness: this process answers; /health is readiness

    @app.get("/metrics")
    async def metrics() -> Any:
        return await serving.metrics()

    @app.post("/sleep")
    async def sleep(model: str | None = None, level: int = 1) -> Any:
        return await serving.sleep(model, level)

    @app.post("/wake_up")
    async def wake_up(
        model: str | None = None, tags: Annotated[list[str] | None, Query()] = None
    ) -> Any:
        return await serving.wake_up(model, tags)

    @app.get("/is_sleeping")
    async def is_sleeping(model: str | None = None) -> Any:
        return await serving.sleep_state(model)

    return app
