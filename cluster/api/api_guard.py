"""A pure ASGI guard in front of the HTTP routes: header count and size (431), API keys (401)
and body size (413), checked before any route reads the request."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.api.api_errors import APIError, error_response

# The probes' paths: a load balancer or kubelet has no API key.
OPEN_PATHS = ("/health", "/livez", "/ping", "/version")
MAX_HEADER_COUNT = 64
MAX_HEADER_BYTES = 16 * 1024


class _BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """Rejects requests with too many or too large headers (431), without a valid API key
    (every route but the probes' /health, /livez, /ping and /version; ``Authorization: Bearer``
    or, as Anthropic's SDK sends it, ``x-api-key``; keys compared as sha256 digests in constant
    time; the path is read from the ASGI scope, not from headers, so ``Host`` or
    ``X-Forwarded-*`` change nothing)
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
            await error_response(headers_error, scope)(scope, receive, send)
            return
        if key_hashes and scope["path"] not in OPEN_PATHS and not _authorized(scope, key_hashes):
            error = APIError(401, "missing or invalid API key", None, "invalid_api_key")
            await error_response(error, scope)(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            await _too_large(max_body, scope)(scope, receive, send)
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
                await _too_large(max_body, scope)(scope, receive, send)

        with contextlib.suppress(_BodyTooLarge):
            await self.app(scope, limited_receive, guarded_send)
        if too_large and not replied:
            await _too_large(max_body, scope)(scope, receive, send)


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


def _too_large(max_body: int, scope: Scope) -> JSONResponse:
    error = APIError(413, f"request body exceeds {max_body} bytes", None, "too_large")
    return error_response(error, scope)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _authorized(scope: Scope, key_hashes: list[str]) -> bool:
    token = request_api_key(_header(scope, b"authorization"), _header(scope, b"x-api-key"))
    return api_key_matches(token, key_hashes)


def request_api_key(authorization: str | None, x_api_key: str | None) -> str:
    """The key a request carries, by one rule for HTTP headers and gRPC metadata: the token of
    ``authorization: Bearer <key>`` (the scheme in any case), else ``x-api-key``; a bare key in
    ``authorization`` (no scheme) is none. "" when there is none."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and token:
        return token
    return x_api_key or ""


def api_key_matches(token: str, key_hashes: list[str]) -> bool:
    if not token.strip():
        return False
    digest = hashlib.sha256(token.strip().encode()).hexdigest()
    # Compare against every key without an early exit: timing does not reveal which matched.
    matches = [hmac.compare_digest(digest, h) for h in key_hashes]
    return any(matches)
