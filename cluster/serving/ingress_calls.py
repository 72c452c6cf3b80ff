"""The ingress's calls to the model servers, past routing: a replica's own failure turned into
a final error item (so HTTP streams end with an error chunk and ``[DONE]``, gRPC with
UNAVAILABLE), the streams of a batched request merged into one, and a model's health asked
(a replica that does not answer is unhealthy), for both HTTP and gRPC; when each model's
streams last brought an item (an engine stepping now, which readiness need not ask); what
the ingress still carries (model streams, HTTP responses being sent), which a stopping ingress
waits for; and the client's 503 for a call no replica took (``call_replica``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import ray
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Receive, Scope, Send

from cluster.api.api_errors import APIError
from cluster.api.replica_messages import StreamError, replica_failed

_T = TypeVar("_T")
# What a call to a model's replicas raises when none took it or the one that did died.
REPLICA_ERRORS = (ray.exceptions.RayError, BackPressureError)


def replica_unavailable(model: str, exc: BaseException) -> APIError:
    """The client's error for a call no replica of ``model`` answered: 503 ``overloaded``
    with ``Retry-After`` (every replica's queue is full: Serve's ``BackPressureError``, which
    is not a ``RayError``), else 503 ``unavailable`` (none runs, or it died)."""
    if isinstance(exc, BackPressureError):
        return APIError(503, f"model {model!r} is overloaded, retry later", None, "overloaded",
                        retry_after=1)  # fmt: skip
    return APIError(503, f"model {model!r} is not available", None, "unavailable")


async def call_replica(model: str, call: Awaitable[_T]) -> _T:
    """``await call`` (a model server's method, or a gather of them), its replica errors as
    ``replica_unavailable``'s 503."""
    try:
        return await call
    except REPLICA_ERRORS as exc:
        raise replica_unavailable(model, exc) from exc


def base_model(model: str, adapter: str | None) -> str:
    """The base model of a routed ``model`` name: itself, or ``<base>:<adapter>``'s base."""
    return model if adapter is None else model[: -len(adapter) - 1]


_open_streams = 0  # guard_stream generators running in this process
_responses_in_flight = 0  # HTTP responses not yet fully sent (``ResponsesInFlight``)
# Routed model name (``<base>`` or ``<base>:<adapter>``) -> when a stream of it last brought an
# item; dropped when one of its streams ends in an error.
_last_item_at: dict[str, float] = {}


def streamed_within(model: str, seconds: float) -> bool:
    """Whether a stream of ``model`` (or of one of its adapters) brought an item in the last
    ``seconds``: an engine of it is stepping now. Readiness reads this rather than asking a
    replica whose every request slot is taken (the call would wait for a slot)."""
    since = time.monotonic() - seconds
    prefix = model + ":"
    return any(
        at >= since
        for name, at in _last_item_at.items()
        if name == model or name.startswith(prefix)
    )


def open_streams() -> int:
    """How many model streams this ingress is carrying now (read from any thread)."""
    return _open_streams


class ResponsesInFlight:
    """ASGI middleware (outermost): counts the HTTP responses this process has not finished
    sending. A streamed response counts until the app returns, after its last message (the
    chunked body's end included), so a stopping ingress knows when its clients have it all."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        global _responses_in_flight
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        _responses_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            _responses_in_flight -= 1


def wait_until_written(timeout_s: float) -> bool:
    """Block (the SIGTERM hook, on the worker's main thread while the event loop runs on its
    own) until every HTTP response has been sent in full and every model stream (gRPC's too)
    has ended, at most ``timeout_s``; True when they have."""
    deadline = time.monotonic() + timeout_s
    while _responses_in_flight or _open_streams:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


async def guard_stream(items: Any, model: str) -> AsyncIterator[Any]:
    """The server's items, with a failure of the replica itself (its process killed, its node
    lost: a Ray error from the handle's stream) turned into a final 503 error item."""
    global _open_streams
    _open_streams += 1
    try:
        async for item in items:
            if isinstance(item, StreamError):
                _last_item_at.pop(model, None)
            else:
                _last_item_at[model] = time.monotonic()
            yield item
    except ray.exceptions.RayError:
        _last_item_at.pop(model, None)
        yield replica_failed(model)
    finally:
        _open_streams -= 1


async def merge_streams(streams: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """``(i, item)`` for the items of every stream i as they come (a batched completions
    request: one server stream per prompt)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: Any) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is done:
                remaining -= 1
                continue
            yield entry
        for task in tasks:
            task.result()  # a stream's own failure surfaces here
    finally:
        for task in tasks:
            task.cancel()


async def model_health(handle: DeploymentHandle, timeout_s: float | None = None) -> dict[str, Any]:
    """A model's ``health`` answer (``{"healthy": bool, "error": ...}``); a replica that does
    not answer (in ``timeout_s``) is unhealthy, whatever the cause."""
    try:
        return await asyncio.wait_for(_response(handle.health.remote()), timeout_s)
    except Exception as exc:  # unreachable replica
        return {"healthy": False, "error": type(exc).__name__}


async def _response(response: Any) -> Any:
    return await response


__all__ = [
    "ResponsesInFlight",
    "guard_stream",
    "merge_streams",
    "model_health",
    "open_streams",
    "streamed_within",
    "wait_until_written",
]
