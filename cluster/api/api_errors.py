"""Errors for API clients: ``APIError`` and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``, and the FastAPI handlers that turn every
failure into one (validation errors name the field; an unexpected exception is a bare 500).
The Anthropic routes (``/v1/messages…``) answer in Anthropic's shape instead,
``{"type": "error", "error": {"type", "message"}}``, an overloaded model as 529."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.api.replica_messages import ERRORS, StreamError, error_type


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


# Routes whose errors take Anthropic's shape, and its error types by status (other 4xx:
# invalid_request_error, other 5xx: api_error).
ANTHROPIC_PREFIX = "/v1/messages"
ANTHROPIC_ERRORS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
    429: "rate_limit_error", 500: "api_error", 529: "overloaded_error",
}  # fmt: skip


def anthropic_route(scope: Any) -> bool:
    """Whether the ASGI ``scope`` is a request to an Anthropic route (behind any route
    prefix that Serve puts in ``root_path``)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path == ANTHROPIC_PREFIX or path.startswith(f"{ANTHROPIC_PREFIX}/")


def anthropic_error(status: int, message: str, code: str | None = None) -> tuple[int, dict]:
    """Anthropic's status and body for an error: an overloaded model (a full queue,
    back-pressure) is 529 ``overloaded_error``."""
    if code == "overloaded":
        status = 529
    kind = ANTHROPIC_ERRORS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def api_error(item: StreamError) -> APIError:
    """The server's error message as the exception the routes raise."""
    return APIError(item.status, item.message, item.param, item.code, item.retry_after)


def renamed(exc: APIError, renames: tuple[tuple[str, str], ...]) -> APIError:
    """``exc`` with its field named as another API names it: the first ``(chat name, name)``
    of ``renames`` that is its ``param`` or a prefix of it (its message's leading name too)."""
    param = exc.param or ""
    for chat_name, name in renames:
        if param == chat_name or param.startswith(f"{chat_name}."):
            new_param = name + param[len(chat_name) :]
            message = exc.message
            if message.startswith(f"{param}:"):
                message = new_param + message[len(param) :]
            return APIError(exc.status, message, new_param, exc.code, exc.retry_after)
    return exc


def error_response(error: APIError, scope: Any = None) -> JSONResponse:
    """The error's response, in Anthropic's shape when ``scope`` is an Anthropic route's."""
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    if scope is not None and anthropic_route(scope):
        status, body = anthropic_error(error.status, error.message, error.code)
        return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "none", "bytes"})


def field_path(loc: list[str]) -> list[str]:
    """A pydantic error location as the request's field path: union members show up in it
    (``prompt.str``, ``prompt.list[int]``, ``x.function-after[...]``) and are dropped
    (``stream`` is a field)."""
    return [p for p in loc if p not in _UNION_MEMBERS and "[" not in p]


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    # A union reports every member's error; a lone surrogate anywhere is the one that explains.
    first = next((e for e in errors if e.get("type") == "invalid_unicode"), errors[0])
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg')}", None, "invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(field_path(loc)) or None
    if param is None:  # the body as a whole: none, or not a JSON object
        message = (f"request body: {first.get('msg')}; send a JSON object with content-type: "
                   "application/json")  # fmt: skip
        return APIError(400, message, None, "invalid_value")
    return APIError(400, f"{param}: {first.get('msg')}", param, "invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.scope)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc), request.scope)

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code if exc.status_code in ERRORS else 400
        return error_response(APIError(status, str(exc.detail)), request.scope)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Our bug, not the client's: a 500 without internals (the replica's log has them).
        return error_response(APIError(500, "internal server error"), request.scope)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
