"""The OpenAI-compatible HTTP front: request models with OpenAI's field names, their mapping to
the engine's ``SamplingParams``, SSE streaming, and OpenAI error bodies.

    POST /v1/completions        POST /v1/chat/completions      GET /v1/models
    POST /tokenize              POST /detokenize               GET /health    GET /metrics

Errors are ``{"error": {"message", "type", "param", "code"}}``: 400 invalid input (naming the
field), 401 missing or wrong API key, 404 unknown model or route, 408 the request's ``timeout``
passed, 413 body too large, 431 too many or too large headers, 503 engine dead or overloaded
(the waiting queue is full: with a ``Retry-After`` header).
Bad input never yields a 500; no error body carries a stack trace, a path or configuration.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any, Literal, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.protocol import (
    ERRORS,
    ChoiceChunk,
    GenerateRequest,
    StreamDelta,
    StreamError,
    StreamItem,
    StreamStart,
    error_type,
)

# ---- request models ---------------------------------------------------------------------------


def _unicode_text(text: str) -> str:
    # JSON can escape a lone surrogate ("\\ud800"); it is no text: the tokenizer, the
    # prefix-cache hash and the UTF-8 error body that echoes a field all fail on it.
    try:
        text.encode()
    except UnicodeEncodeError:
        raise PydanticCustomError(
            "invalid_unicode", "must be valid Unicode text (no lone surrogates)"
        ) from None
    return text


# Every string field of a request.
Text = Annotated[str, AfterValidator(_unicode_text)]


def _ranged(default: Any, **bounds: int | float) -> Any:
    """A field whose range the OpenAPI schema states (JSON Schema ``minimum``, ``maximum``,
    ``exclusiveMinimum``) for clients and fuzzers. The engine checks it, as for gRPC and
    offline requests, and its 400 names the field; caps that a server sets (``max_n``,
    ``max_logprobs``, ``max_model_len``) are not in the schema."""
    return Field(default, json_schema_extra=bounds)


_INT64 = {"minimum": -(2**63), "maximum": 2**63 - 1}
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0})]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields every generation request shares (OpenAI names, vLLM extensions last)."""

    model: Text
    temperature: float = _ranged(1.0, minimum=0)
    top_p: float = _ranged(1.0, exclusiveMinimum=0, maximum=1)
    n: int = _ranged(1, minimum=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = _ranged(None, **_INT64)
    presence_penalty: float = _ranged(0.0, minimum=-2, maximum=2)
    frequency_penalty: float = _ranged(0.0, minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: Text | None = None
    top_k: int = _ranged(0, minimum=-1)  # 0 and -1: disabled
    min_p: float = _ranged(0.0, minimum=0, maximum=1)
    repetition_penalty: float = _ranged(1.0, exclusiveMinimum=0)
    min_tokens: int = _ranged(0, minimum=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[Text] | None = None
    skip_special_tokens: bool = True
    # Requests with different salts never share prefix-cache blocks (tenant isolation).
    cache_salt: Text | None = None
    # Seconds: past it the request is aborted, its KV blocks freed, and the client gets a 408.
    timeout: float | None = _ranged(None, exclusiveMinimum=0)


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = _ranged(16, minimum=1)
    logprobs: int | None = _ranged(None, minimum=0)
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[dict[str, Any]] | None = None
    name: Text | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = _ranged(None, minimum=1)
    max_completion_tokens: int | None = _ranged(None, minimum=1)
    logprobs: bool = False
    top_logprobs: int | None = _ranged(None, minimum=0)
    # Declared so that their 400 says why: only the model's own template is ever rendered.
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Strict):
    model: Text
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)


class DetokenizeRequest(_Strict):
    model: Text
    tokens: list[TokenId]


# ---- errors -----------------------------------------------------------------------------------


class APIError(Exception):
    """An error for the client; ``retry_after`` (seconds) becomes a ``Retry-After`` header."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[type[APIError], tuple[Any, ...]]:
        # Ray ships exceptions by pickle (Serve's gRPC proxy, handles): keep every field.
        return (APIError, (self.status, self.message, self.param, self.code, self.retry_after))

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = error_type(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def api_error(item: StreamError) -> APIError:
    """The server's error message as the exception the routes raise."""
    return APIError(item.status, item.message, item.param, item.code, item.retry_after)


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    # A union reports every member's error; a lone surrogate anywhere is the one that explains.
    first = next((e for e in errors if e.get("type") == "invalid_unicode"), errors[0])
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg')}", None, "invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members show up in the location (``prompt.str``): keep the field path only.
    loc = [
        p for p in loc if not p.startswith(("str", "list[", "int", "float", "bool", "function-"))
    ]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return APIError(400, message, param, "invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code if exc.status_code in ERRORS else 400
        return error_response(APIError(status, str(exc.detail)))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Our bug, not the client's: a 500 without internals (the replica's log has them).
        return JSONResponse(error_body(500, "internal server error"), status_code=500)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)


# ---- API keys and body size: a pure ASGI guard in front of the routes ---------------------------


MAX_HEADER_COUNT = 64
MAX_HEADER_BYTES = 16 * 1024


class _BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """Rejects requests with too many or too large headers (431), without a valid API key
    (every route but /health; keys compared as sha256 digests in constant time; the path is
    read from the ASGI scope, not from headers, so ``Host`` or ``X-Forwarded-*`` change nothing)
    and bodies over ``max_body_bytes`` (413), whether or not they declare a length.
    Settings come from ``app.state`` so the ingress can set them at startup."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        key_hashes: list[str] = getattr(state, "api_key_hashes", [])
        max_body: int = getattr(state, "max_body_bytes", 1 << 20)
        headers_error = _check_headers(scope, state)
        if headers_error is not None:
            await error_response(headers_error)(scope, receive, send)
            return
        if key_hashes and scope["path"] != "/health" and not _authorized(scope, key_hashes):
            error = APIError(401, "missing or invalid API key", None, "invalid_api_key")
            await error_response(error)(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            await _too_large(max_body)(scope, receive, send)
            return
        await self._limit_body(scope, receive, send, max_body)

    async def _limit_body(self, scope: Scope, receive: Receive, send: Send, max_body: int) -> None:
        """Count body bytes as the app reads them; past the limit the app's own response (its
        body parser fails on the truncated read) is replaced by a 413."""
        received = 0
        too_large = False
        replied = False

        async def limited_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_body:
                    too_large = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal replied
            if not too_large:
                await send(message)
            elif not replied:
                replied = True
                await _too_large(max_body)(scope, receive, send)

        with contextlib.suppress(_BodyTooLarge):
            await self.app(scope, limited_receive, guarded_send)
        if too_large and not replied:
            await _too_large(max_body)(scope, receive, send)


def _check_headers(scope: Scope, state: Any) -> APIError | None:
    """431 when a request has more headers, or more header bytes, than the server allows:
    checked before anything reads them, so a flood of headers costs one pass."""
    max_count: int = getattr(state, "max_header_count", MAX_HEADER_COUNT)
    max_bytes: int = getattr(state, "max_header_bytes", MAX_HEADER_BYTES)
    headers = scope.get("headers", [])
    if len(headers) > max_count:
        message = f"the request has {len(headers)} headers; at most {max_count} are allowed"
        return APIError(431, message, None, "too_many_headers")
    size = sum(len(k) + len(v) for k, v in headers)
    if size > max_bytes:
        message = f"the request's headers total {size} bytes; at most {max_bytes} are allowed"
        return APIError(431, message, None, "headers_too_large")
    return None


def _too_large(max_body: int) -> JSONResponse:
    return error_response(
        APIError(413, f"request body exceeds {max_body} bytes", None, "too_large")
    )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _authorized(scope: Scope, key_hashes: list[str]) -> bool:
    auth = _header(scope, b"authorization") or ""
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token:
        token = _header(scope, b"x-api-key") or ""
    return api_key_matches(token, key_hashes)


def api_key_matches(token: str, key_hashes: list[str]) -> bool:
    if not token.strip():
        return False
    digest = hashlib.sha256(token.strip().encode()).hexdigest()
    # Compare against every key without an early exit: timing does not reveal which matched.
    matches = [hmac.compare_digest(digest, h) for h in key_hashes]
    return any(matches)


# ---- request -> engine payload ----------------------------------------------------------------


# Fields passed to the engine under the same name when they differ from its default (the engine
# checks their ranges and caps, and its 400s name them).
_SAME_NAME_FIELDS = (
    "n", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "stop_token_ids", "include_stop_str_in_output", "logit_bias", "bad_words",
)  # fmt: skip


def sampling_params(req: _SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed with stream: true", "stream_options")
    params: dict[str, Any] = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_tokens": max_tokens,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
    }
    defaults = _SamplingFields.model_fields
    for name in _SAME_NAME_FIELDS:
        value = getattr(req, name)
        if value != defaults[name].default:
            params[name] = value
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    return params


def completion_payload(req: CompletionRequest) -> GenerateRequest:
    # best_of = n samples n and returns them all; ranking more samples than returned is not done.
    if req.best_of is not None and req.best_of not in (1, req.n):
        raise APIError(400, f"best_of: only best_of = n ({req.n}) is supported", "best_of",
                       "unsupported")  # fmt: skip
    for name, bad in {"echo": req.echo, "suffix": bool(req.suffix)}.items():
        if bad:
            raise APIError(400, f"{name}: not supported", name, "unsupported")
    params = sampling_params(req, req.max_tokens)
    if req.logprobs is not None:
        params["logprobs"] = req.logprobs
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "prompt: exactly one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return GenerateRequest(params=params, prompt_token_ids=prompt, **request_extras(req))
    return GenerateRequest(params=params, prompt=prompt, **request_extras(req))


def chat_payload(req: ChatCompletionRequest) -> GenerateRequest:
    for name in ("chat_template", "chat_template_kwargs"):
        if getattr(req, name) is not None:
            raise APIError(400, f"{name}: request-supplied chat templates are not accepted; the "
                           "model's own template is used", name, "unsupported")  # fmt: skip
    max_tokens = req.max_completion_tokens
    max_tokens = max_tokens if max_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs: true", "top_logprobs")
    if req.logprobs:
        params["logprobs"] = req.top_logprobs or 0
    return GenerateRequest(
        params=params, messages=chat_messages(req.messages), **request_extras(req)
    )


def request_extras(req: _SamplingFields) -> dict[str, Any]:
    """Per-request settings beside the sampling parameters (the server checks them)."""
    extras = {"cache_salt": req.cache_salt, "timeout": req.timeout}
    return {k: v for k, v in extras.items() if v is not None}


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template: content parts (``[{"type": "text", "text": ...}]``)
    joined into one string; parts other than text are not supported (400)."""
    out = []
    for i, message in enumerate(messages):
        entry = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            texts = []
            for j, part in enumerate(message.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    param = f"messages.{i}.content.{j}"
                    raise APIError(400, f"{param}: only text parts are supported", param)
                texts.append(part["text"])
            entry["content"] = "".join(texts)
        out.append(entry)
    return out


# ---- responses ----------------------------------------------------------------------------------


class _Choice:
    """One choice of a response as it accumulates."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self.text_offset = 0  # where the next token starts in the text (completions logprobs)
        self.logprobs: Any = None  # completions: the OpenAI dict; chat: the content list
        self.started = False


class Completion:
    """Turns the server's stream of items into OpenAI responses (whole or as SSE chunks).
    ``top_logprobs`` is the number of alternatives a chat request asked for, or the ``logprobs``
    of a completions request; None when it asked for no logprobs."""

    def __init__(
        self, model: str, chat: bool, include_usage: bool, top_logprobs: int | None = None
    ) -> None:
        self.model, self.chat, self.include_usage = model, chat, include_usage
        self.top_logprobs = top_logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.choices = [_Choice(0)]

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def usage(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": total}  # fmt: skip

    def absorb(self, item: StreamStart | StreamDelta) -> list[dict[str, Any]]:
        """Take in a server item; returns the chunk choices it makes for a stream (a choice's
        first delta, and every delta with text, tokens, logprobs or its finish)."""
        if isinstance(item, StreamStart):
            self.prompt_tokens = item.prompt_tokens
            self.choices = [_Choice(i) for i in range(item.n)]
            return []
        return [c for d in item.choices if (c := self._absorb_choice(d)) is not None]

    def _absorb_choice(self, delta: ChoiceChunk) -> dict[str, Any] | None:
        choice = self.choices[delta.index]
        first, choice.started = not choice.started, True
        choice.text += delta.text
        choice.num_tokens = delta.num_output_tokens
        # "stop", "length", or (as vLLM sends it) "abort": the replica shut down past its drain.
        finish = delta.finish_reason
        if finish is not None:
            choice.finish_reason = finish
        logprobs = self._logprobs(choice, delta.logprobs)
        # As vLLM does: a step that produced tokens is a chunk even when their text is empty
        # (an incomplete character, a special token), so clients see steady token timing.
        if not (first or delta.text or delta.token_ids or finish or logprobs):
            return None
        if self.chat:
            content: dict[str, Any] = {"content": delta.text}
            if first:
                content = {"role": "assistant", **content}
            chat_lp = {"content": logprobs} if logprobs is not None else None
            return {"index": choice.index, "delta": content, "logprobs": chat_lp,
                    "finish_reason": finish}  # fmt: skip
        return {"index": choice.index, "text": delta.text, "logprobs": logprobs,
                "finish_reason": finish}  # fmt: skip

    def _logprobs(self, choice: _Choice, entries: list[Any] | None) -> Any:
        """The OpenAI logprobs of a delta's new tokens, also appended to the choice's."""
        if self.top_logprobs is None or entries is None:
            return None
        if self.chat:
            new = chat_logprobs(entries, self.top_logprobs)
            choice.logprobs = (choice.logprobs or []) + new
            return new
        new = completion_logprobs(entries, choice.text_offset)
        choice.text_offset += sum(len(t) for t in new["tokens"])
        whole = choice.logprobs or {k: [] for k in new}
        choice.logprobs = {k: whole[k] + new[k] for k in new}
        return new

    def whole(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            if self.chat:
                logprobs = {"content": c.logprobs or []} if self.top_logprobs is not None else None
                choices.append({"index": c.index, "logprobs": logprobs,
                                "message": {"role": "assistant", "content": c.text},
                                "finish_reason": c.finish_reason})  # fmt: skip
            else:
                logprobs = c.logprobs
                if logprobs is None and self.top_logprobs is not None:
                    logprobs = completion_logprobs([])
                choices.append({"index": c.index, "text": c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})  # fmt: skip
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage}  # fmt: skip

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return self._chunk_envelope([choice])

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._chunk_envelope([]), "usage": self.usage}

    def _chunk_envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        envelope = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                    "choices": choices}  # fmt: skip
        if self.include_usage:
            envelope["usage"] = None
        return envelope


# JSON has no -inf: a token the model rules out entirely gets this floor (as vLLM does).
_MIN_LOGPROB = -9999.0


def completion_logprobs(entries: list[Any], text_offset: int = 0) -> dict[str, list[Any]]:
    """OpenAI completions logprobs of tokens whose server entries (per token: ``[token_id, text,
    logprob, rank]`` rows, the sampled token first, then the top-k) are ``entries``;
    ``top_logprobs`` maps text -> logprob over the sampled token and the top-k (at most k + 1;
    tokens with the same text keep the higher logprob)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for rows in entries:
        _, text, logprob, _ = rows[0]
        tokens.append(text)
        token_logprobs.append(max(logprob, _MIN_LOGPROB))
        top: dict[str, float] = {}
        for _, alt, alt_logprob, _ in rows:
            top[alt] = max(top.get(alt, _MIN_LOGPROB), alt_logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}  # fmt: skip


def chat_logprobs(entries: list[Any], top_k: int) -> list[dict[str, Any]]:
    """OpenAI chat ``logprobs.content`` of tokens with server entries ``entries`` (as in
    ``completion_logprobs``): each sampled token with its ``top_k`` most likely alternatives."""

    def token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": max(logprob, _MIN_LOGPROB),
                "bytes": list(text.encode())}  # fmt: skip

    content = []
    for rows in entries:
        _, text, logprob, _ = rows[0]
        # The rows are the top-k plus the sampled token (which may rank below them): the k most
        # likely rows are the top-k, whether or not the sampled token is among them.
        best = sorted(rows, key=lambda row: -row[2])[:top_k]
        content.append({**token(text, logprob), "top_logprobs": [token(r[1], r[2]) for r in best]})
    return content


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def stream_sse(
    completion: Completion, items: AsyncIterator[StreamItem], on_close: Callable[[], None]
) -> AsyncIterator[bytes]:
    """SSE chunks for the rest of a stream whose "start" item was already read: one chunk per
    choice delta, its ``choices[0].index`` saying which choice."""
    try:
        async for item in items:
            if isinstance(item, StreamError):
                yield sse(error_body(item.status, item.message, item.param))
                break
            for choice in completion.absorb(item):
                yield sse(completion.chunk(choice))
        if completion.include_usage:
            yield sse(completion.usage_chunk())
        yield sse("[DONE]")
    finally:
        on_close()


TIMEOUT_HEADER = "x-request-timeout"


def with_header_timeout(req: Any, request: Request) -> Any:
    """The request with its ``X-Request-Timeout`` header (seconds) as ``timeout`` when the body
    sets none; the body's field wins. The server checks the range (> 0)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None or req.timeout is not None:
        return req
    try:
        seconds = float(raw)
    except ValueError:
        raise APIError(400, f"{TIMEOUT_HEADER}: must be a number of seconds, got {raw[:32]!r}",
                       TIMEOUT_HEADER) from None  # fmt: skip
    if not seconds > 0 or seconds == float("inf"):
        raise APIError(400, f"{TIMEOUT_HEADER}: must be > 0 seconds, got {raw[:32]!r}",
                       TIMEOUT_HEADER)  # fmt: skip
    return req.model_copy(update={"timeout": seconds})


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
    async def models(self) -> dict[str, Any]: ...
    async def tokenize(self, req: TokenizeRequest) -> Any: ...
    async def detokenize(self, req: DetokenizeRequest) -> Any: ...
    async def health(self) -> Any: ...
    async def metrics(self) -> Any: ...


def make_openai_app(
    serving: OpenAIServing, api_key_hashes: Sequence[str] = (), max_body_bytes: int = 1 << 20
) -> FastAPI:
    """The HTTP routes over ``serving``."""
    app = new_app(api_key_hashes, max_body_bytes)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await serving.completions(with_header_timeout(req, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        return await serving.chat_completions(with_header_timeout(req, request))

    @app.get("/v1/models")
    async def models() -> Any:
        return await serving.models()

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Any:
        return await serving.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Any:
        return await serving.detokenize(req)

    @app.get("/health")
    async def health() -> Any:
        return await serving.health()

    @app.get("/metrics")
    async def metrics() -> Any:
        return await serving.metrics()

    return app
