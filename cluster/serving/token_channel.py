"""The ingress's token channel: each engine step's deltas for all of this ingress's requests on
one head, in one message, instead of one Serve stream item per request per step (each ~0.5 ms
of CPU on 2 cores: BENCHMARKS.md, "Serving path").

    ingress (this module)                     LLMServer replica            HeadActor
    ─────────────────────                     ─────────────────            ─────────
    register(request_id) → queue
    GenerateRequest(channel=sink) ── Serve ──▶ generate ── AddRequest(sink) ──▶ routes its deltas
                           ◀── StreamStart(head=name)                           to the sink
    TokenListener (the sink: tcp://HOST:PORT/TOKEN) ◀── one frame per step ──── its SinkPusher
    ChannelStream: the request's deltas from its queue; its Serve stream carries only the end
    (or a StreamError: 408, 503), which the stream waits for before it ends.

The request's Serve call stays open until it ends, so routing, ``max_ongoing_requests``,
autoscaling, back-pressure, drain and cancellation are Serve's as before. A head whose
connection ends, or whose last frame says its engine died, ends its requests' streams with a 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import RayError

from cluster.api.replica_messages import (
    StreamDelta,
    StreamError,
    replica_failed,
    unavailable,
)
from cluster.serving.head_messages import PollReply
from cluster.serving.token_push import TokenListener
from engine.client.core_messages import RequestDelta, decode_steps

logger = logging.getLogger("llm_cluster.token_channel")

# The replica said the request ended, but its last delta has not come: how long to wait for it.
_LAST_DELTA_WAIT_S = 30.0
_SERVED = object()  # the request's Serve stream ended without an error


class TokenChannel:
    """One per ingress replica; everything runs on the ingress's event loop.

    With 64 requests one stream item per request per step is ~30 ms of CPU a step on a 2-core
    machine, taken from the engine; one frame per step per head costs the same whatever the
    batch. The request's Serve call stays open until it ends, so routing,
    ``max_ongoing_requests``, autoscaling, back-pressure, drain and cancellation (the client
    goes away: the call is cancelled, the replica aborts the request) are Serve's as before.

    The sink is this ingress's TCP listener (``cluster.serving.token_push``): each head connects
    to it and writes every step's deltas as one frame, acknowledged on the same connection
    when the head asks (a drain); a head's connection that ends fails its streams with a 503.
    """

    def __init__(self) -> None:
        self._listener = TokenListener(self._on_pushed, self._on_lost)
        self._listening: asyncio.Future[str] | None = None
        self._model_of_head: dict[str, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the ingress's, once serving
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._head_of: dict[str, str] = {}  # request id -> head actor name

    async def sink(self) -> str:
        """What a request's ``GenerateRequest.channel`` names: this ingress's listener (started
        on first use, on this event loop)."""
        self._loop = asyncio.get_running_loop()
        if self._listening is None:
            host = ray.util.get_node_ip_address()
            self._listening = asyncio.ensure_future(self._listener.start(host))
        return await asyncio.shield(self._listening)

    def register(self, request_id: str) -> None:
        """Before the request is sent: its first delta may come before its ``StreamStart``."""
        self._queues[request_id] = asyncio.Queue()

    def release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._head_of.pop(request_id, None)

    def stream(self, request_id: str, head: str, served: Any, model: str) -> ChannelStream:
        """The request's items once its ``StreamStart`` named ``head``; ``served`` is its Serve
        stream (after the start item)."""
        queue = self._queues.get(request_id)
        if queue is None:
            raise RuntimeError(f"request {request_id!r} was not registered")
        self._head_of[request_id] = head
        self._model_of_head[head] = model
        return ChannelStream(self, request_id, queue, served, model)

    def _requests_on(self, head: str) -> list[str]:
        return [rid for rid, h in self._head_of.items() if h == head]

    def _on_pushed(self, head: str, reply: PollReply) -> None:
        """A head's frame (``token_push``): its steps come once each, in order."""
        for step in decode_steps(reply.steps):
            self._dispatch(step.deltas)
        if reply.dead is not None:
            logger.error("engine head %s reports its engine dead: %s", head, reply.dead)
            model = self._model_of_head.get(head, head)
            self._fail(head, unavailable(f"the engine for {model!r} failed"))

    def _on_lost(self, head: str) -> None:
        """A head's connection ended: the streams still open on it get a 503."""
        if self._requests_on(head):
            logger.error("engine head %s: its token channel ended", head)
            self._fail(head, replica_failed(self._model_of_head.get(head, head)))

    def end_all_threadsafe(self, error: StreamError) -> None:
        """From any thread (the ingress's SIGTERM hook): every open stream gets ``error``, its
        last item."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._end_all, error)

    def _end_all(self, error: StreamError) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:  # else: its client went away
                queue.put_nowait(delta)

    def _fail(self, head: str, error: StreamError) -> None:
        for request_id in self._requests_on(head):
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(error)


class ChannelStream:
    """A generation's items, like its Serve stream's without the channel: ``StreamDelta``s
    (from the channel), then, if the replica sent one, its ``StreamError``. Ends once both the
    last delta has come and the Serve stream has ended. ``cancel`` ends it early (the replica
    aborts the request)."""

    def __init__(
        self,
        channel: TokenChannel,
        request_id: str,
        queue: asyncio.Queue[Any],
        served: Any,
        model: str,
    ) -> None:
        self._channel = channel
        self._request_id = request_id
        self._queue = queue
        self._served = served
        self._model = model
        self._pump = asyncio.ensure_future(self._watch_served())

    async def _watch_served(self) -> None:
        try:
            async for item in self._served:
                self._queue.put_nowait(item)
        except RayError:
            self._queue.put_nowait(replica_failed(self._model))
        else:
            self._queue.put_nowait(_SERVED)

    def __aiter__(self) -> AsyncIterator[StreamDelta | StreamError]:
        return self._items()

    async def _items(self) -> AsyncIterator[StreamDelta | StreamError]:
        finished = served = False
        try:
            while not (finished and served):
                timeout = _LAST_DELTA_WAIT_S if served else None
                try:
                    item = await asyncio.wait_for(self._queue.get(), timeout)
                except TimeoutError:
                    logger.error("request %s: its replica ended it, its last delta never came",
                                 self._request_id)  # fmt: skip
                    yield unavailable(
                        f"the replica serving {self._model!r} lost its last tokens; retry"
                    )
                    return
                if item is _SERVED:
                    served = True
                elif isinstance(item, RequestDelta):
                    finished = item.finished
                    yield StreamDelta(item.choices, num_cached_tokens=item.num_cached_tokens)
                else:  # StreamError (the replica's, or the head's failure); a StreamDelta
                    yield item
                    if isinstance(item, StreamError):
                        return
        finally:
            self._channel.release(self._request_id)

    def cancel(self) -> None:
        self._channel.release(self._request_id)
        self._served.cancel()
        self._pump.cancel()


__all__ = ["ChannelStream", "TokenChannel"]
