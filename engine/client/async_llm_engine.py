"""``AsyncLLMEngine``: the front of the engine — one asyncio stream per request — over an engine
core that runs elsewhere (``engine.client.core_client``): on a thread of this process, or in the
head actor of a Serve replica.

    event loop (HTTP / gRPC handlers)              engine core (thread or head actor)
    ─────────────────────────────────              ──────────────────────────────────
    generate() ── AddRequest ─────────────────▶    validate, enqueue (errors come back here)
      ▲                                            step() … one StepOutputs per step
      └── per-request asyncio.Queue ◀── fan-out ◀─ (all requests' deltas in one message)

The front does only per-request bookkeeping: it keeps each request's output so far and hands it
deltas. Deltas that pile up while a consumer is busy are merged into one item. Closing or
cancelling a stream before its last item aborts the request in the core (within one step).
``encode`` (embeddings) is a request whose stream carries one item: its pooled vector.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.client.core_client import EngineCoreClient, InProcessCoreClient
from engine.client.core_messages import (
    AddRequest,
    ChoiceDelta,
    CoreStats,
    RequestDelta,
    StepOutputs,
    merge_deltas,
)
from engine.config import EngineConfig
from engine.core.data_parallel import build_engine
from engine.core.llm_engine import LLMEngine, PromptType
from engine.core.request_queue import check_priority
from engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    RequestAbortedError,
    check_request_id_unused,
)
from engine.lora import LoRARequest
from engine.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")

# Kept under its old name: what ``get_stats`` returns.
EngineStats = CoreStats


@dataclass(frozen=True)
class StreamOutput:
    """One item of a request's stream: the request's output as its ``output_kind`` asks
    (``output``: by default everything so far, one object updated in place as the stream goes
    on; with ``DELTA`` a new object holding only this item's new pieces; with ``FINAL_ONLY`` one
    item, at the end) plus, per choice that has something new, its delta (``deltas``, ordered
    by index). Concatenating a choice's delta texts gives its final text
    exactly: while stop strings could still match, its last ``max(len(stop)) - 1`` characters
    are held back. A delta may have tokens and no text (an incomplete character)."""

    output: RequestOutput
    deltas: list[ChoiceDelta]
    # Monotonic time (this process's clock) of the step that produced the newest token here.
    time: float = field(default=0.0)
    # Every step merged into this item that made tokens: (monotonic time, how many), oldest
    # first. One entry unless items piled up or a head's tally stands for several (``sink``).
    steps: tuple[tuple[float, int], ...] = ()

    @property
    def finished(self) -> bool:
        return self.output.finished

    @property
    def delta_text(self) -> str:
        """Choice 0's new text (the whole delta of an n = 1 request)."""
        return next((d.text for d in self.deltas if d.index == 0), "")

    @property
    def delta_token_ids(self) -> list[int]:
        """Choice 0's new token ids (the whole delta of an n = 1 request)."""
        return next((d.token_ids for d in self.deltas if d.index == 0), [])

    @property
    def num_new_tokens(self) -> int:
        return sum(len(d.token_ids) for d in self.deltas)

    @property
    def text(self) -> str:
        return self.output.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.output.outputs[0].finish_reason


class _Stream:
    """The event-loop side of one request: its loop and a queue of (delta, time) items or an
    exception. Its output is made by ``start`` once the core accepted the request (n checked)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # (delta, monotonic time of its step, its steps' (time, tokens)) or an exception.
        self.queue: asyncio.Queue[
            tuple[RequestDelta, float, list[tuple[float, int]]] | BaseException
        ] = asyncio.Queue()
        self.finished = False
        self.output: RequestOutput | None = None
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []

    def start(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        wants_logprobs = params.logprobs is not None
        completions = [
            CompletionOutput(i, "", [], logprobs=[] if wants_logprobs else None)
            for i in range(params.n)
        ]
        self.output = RequestOutput(request_id, prompt, prompt_token_ids, completions, False)

    def delta_output(self, delta: RequestDelta) -> RequestOutput:
        """``output_kind=DELTA``: an output of only what ``delta`` brings (its choices' new
        text, token ids and logprobs; prompt logprobs with the first)."""
        started = self.output
        assert started is not None  # started before any delta can be read
        completions = [
            CompletionOutput(
                choice.index,
                choice.text,
                list(choice.token_ids),
                cumulative_logprob=choice.cumulative_logprob,
                logprobs=list(choice.logprobs) if choice.logprobs is not None else None,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            for choice in delta.choices
        ]
        return RequestOutput(
            started.request_id,
            started.prompt,
            started.prompt_token_ids,
            completions,
            delta.finished,
            prompt_logprobs=delta.prompt_logprobs,
            num_cached_tokens=delta.num_cached_tokens,
            kv_transfer_params=delta.kv_transfer_params,
        )

    def absorb(self, delta: RequestDelta) -> None:
        output = self.output
        assert output is not None  # started before any delta can be read
        for choice in delta.choices:
            completion = output.outputs[choice.index]
            completion.text += choice.text
            completion.token_ids.extend(choice.token_ids)
            if choice.logprobs is not None and completion.logprobs is not None:
                completion.logprobs.extend(choice.logprobs)
            completion.cumulative_logprob = choice.cumulative_logprob
            if choice.finish_reason is not None:
                completion.finish_reason = choice.finish_reason
                completion.stop_reason = choice.stop_reason
        if delta.prompt_logprobs is not None:
            output.prompt_logprobs = delta.prompt_logprobs
        output.num_cached_tokens = delta.num_cached_tokens
        output.finished = delta.finished
        if delta.kv_transfer_params is not None:
            output.kv_transfer_params = delta.kv_transfer_params


class AsyncLLMEngine:
    """The front over an engine core; ``generate`` streams outputs.

    ``AsyncLLMEngine.from_engine_args(...)`` builds and runs the core on a thread of this
    process; ``AsyncLLMEngine(client)`` runs it wherever ``client`` reaches (a Ray head actor).
    ``AsyncLLMEngine(LLMEngine(config))`` works too, but steps an engine built on another thread:
    on CPU that runs ~25 % slower (``engine.client.core_loop.EngineCoreLoop``)."""

    def __init__(
        self, engine: LLMEngine | EngineCoreClient, *, tokenizer: Any | None = None
    ) -> None:
        self.client = (
            engine if isinstance(engine, EngineCoreClient) else InProcessCoreClient(engine)
        )
        self.config: EngineConfig = self.client.config
        if tokenizer is None:
            tokenizer = getattr(self.client, "tokenizer", None)
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}
        # Requests whose add the core has not answered yet: an abort of one is sent again then.
        self._adding: dict[str, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._dead: EngineDeadError | None = None
        # The core's threads call back through weak references, so an engine dropped without
        # shutdown() is collected and its core stopped (its weights, KV cache and threads
        # freed), as vLLM's AsyncLLM is.
        self.client.start(_weakly(self._on_step), _weakly(self._on_dead))
        weakref.finalize(self, self.client.shutdown)

    @classmethod
    def from_engine_args(cls, **engine_args: Any) -> AsyncLLMEngine:
        """The engine built (and run) on the core thread."""
        config = EngineConfig.from_kwargs(**engine_args)
        return cls(InProcessCoreClient(lambda: build_engine(config)))

    @property
    def engine(self) -> LLMEngine:
        """The in-process core's ``LLMEngine`` (tests and tools; not for a remote core)."""
        if not isinstance(self.client, InProcessCoreClient):
            raise AttributeError("the engine core runs in another process")
        return self.client.engine

    # ---- public API (event loop side) ---------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
        lora_request: LoRARequest | None = None,
        sink: str | None = None,
    ) -> AsyncIterator[StreamOutput]:
        """Stream a request's outputs. Raises ``InvalidRequestError`` before anything is
        enqueued when the request is invalid, ``EngineDeadError`` if the engine fails. Closing
        or cancelling the iterator before the last output aborts the request. ``timeout_s``
        (seconds from now) is a deadline: past it the request is aborted, its blocks are freed
        and its stream ends with finish_reason "abort". ``lora_request`` runs it under that
        LoRA adapter (the engine needs ``enable_lora``).

        ``sink`` names a second reader of its deltas that the core's host serves
        (``AddRequest.sink``: an ingress's token channel, which gets every step's). This stream
        then yields a first item as soon as the core has accepted the request (no deltas yet),
        and a head hands it only tallies of the request's first delta and its last (finishes
        and token counts, no text or tokens; ``StreamOutput.steps`` has every step's time)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        params = params or SamplingParams()
        if timeout_s is not None and not (_is_number(timeout_s) and timeout_s > 0):
            raise InvalidRequestError(f"must be > 0 seconds, got {timeout_s!r}", param="timeout")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError("must be a LoRARequest", param="lora_request")
        stream = await self._add(
            request_id, prompt, params, priority, cache_salt, lora_request, sink
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s is not None else None
        try:
            if sink is not None:
                assert stream.output is not None  # started by _add
                yield StreamOutput(stream.output, [], time.monotonic())
            while True:
                try:
                    remaining = deadline - loop.time() if deadline is not None else None
                    item = await asyncio.wait_for(stream.queue.get(), remaining)
                except TimeoutError:
                    # Past the deadline: the abort's final delta arrives on the queue.
                    deadline = None
                    self.client.abort([request_id])
                    continue
                items = [item]
                # Merge what piled up while the consumer was busy into one item.
                while not stream.queue.empty():
                    items.append(stream.queue.get_nowait())
                error = next((i for i in items if isinstance(i, BaseException)), None)
                if error is not None:
                    stream.finished = True
                    raise error
                deltas = [d for d, _, _ in items]  # type: ignore[misc]
                steps = tuple(s for _, _, item_steps in items for s in item_steps)  # type: ignore[misc]
                merged = merge_deltas(deltas) if len(deltas) > 1 else deltas[0]
                stream.finished = merged.finished
                if params.output_kind == RequestOutputKind.DELTA:
                    output = stream.delta_output(merged)
                else:
                    stream.absorb(merged)
                    assert stream.output is not None
                    output = stream.output
                    if params.output_kind == RequestOutputKind.FINAL_ONLY and not merged.finished:
                        continue
                yield StreamOutput(output, merged.choices, items[-1][1], steps)  # type: ignore[index]
                if merged.finished:
                    return
        finally:
            if not stream.finished:
                self._streams.pop(request_id, None)
                with contextlib.suppress(EngineDeadError):
                    self.client.abort([request_id])

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
    ) -> PoolingRequestOutput:
        """The prompt's pooled final hidden states (an embedding; the engine's
        ``pooling_type``), once its whole prompt is computed. Raises ``InvalidRequestError``
        before anything is enqueued when the request is invalid, ``EngineDeadError`` if the
        engine fails, ``RequestAbortedError`` if ``abort`` ended it first. Cancelling the call
        aborts the request (its blocks are free within one step)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        params = pooling_params or PoolingParams()
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError("must be a PoolingParams", param="pooling_params")
        stream = await self._add(request_id, prompt, params, priority, None)
        try:
            # The core sends one delta for a pooling request: finished, with its vector.
            item = await stream.queue.get()
            stream.finished = True
            if isinstance(item, BaseException):
                raise item
            delta = item[0]
            if delta.embedding is None:
                raise RequestAbortedError(f"request {request_id!r} was aborted")
            return PoolingRequestOutput(
                request_id=request_id,
                prompt_token_ids=stream.prompt_token_ids,
                outputs=PoolingOutput(delta.embedding),
                finished=True,
                prompt=stream.prompt,
                num_cached_tokens=delta.num_cached_tokens,
            )
        finally:
            if not stream.finished:
                self._streams.pop(request_id, None)
                with contextlib.suppress(EngineDeadError):
                    self.client.abort([request_id])

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort". One whose add the core
        has not answered yet is aborted again once it has: a core that takes commands in order
        (in process, a child process) has the abort right after the add, before any step, but
        a head in another process takes the two as separate calls and may handle the abort
        first, finding nothing (an unknown or finished id is ignored)."""
        add = self._adding.get(request_id)
        if add is not None and not add.done():
            add.add_done_callback(lambda done: self._abort_if_added(done, request_id))
        self.client.abort([request_id])

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the in-process core's thread between steps."""
        client = self.client
        if not isinstance(client, InProcessCoreClient):
            raise RuntimeError("call() needs an in-process engine core")
        return await asyncio.wrap_future(client.loop.call(fn))

    async def sleep(self, level: int = 1) -> None:
        """``LLMEngine.sleep`` on the core (idle only: ``EngineStateError`` otherwise)."""
        await self.client.control("sleep", (level,))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.client.control("wake_up", (tags,))

    async def is_sleeping(self) -> bool:
        return bool(await self.client.control("is_sleeping"))

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.control("reset_prefix_cache"))

    async def get_stats(self) -> EngineStats:
        return await self.client.stats()

    async def request_state(self) -> dict[str, Any]:
        """Per-request state still held: the front's streams, the core's tables and each
        worker's (every count 0 once idle; anything else is a leak)."""
        state = await self.client.request_state()
        state["head"]["streams"] = len(self._streams)
        return state

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine is known to be dead (no round trip; for the
        in-process core this also runs the core's own checks)."""
        if self._dead is not None:
            raise self._dead
        if isinstance(self.client, InProcessCoreClient):
            self.client.loop.check_health()
        elif self.client.is_dead:
            raise EngineDeadError("the engine core is gone")

    async def check_engine_health(self) -> None:
        """``check_health`` plus a round trip to the core: its loop, watchdog and workers."""
        self.check_health()
        await self.client.check_health()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None or self.client.is_dead

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core (in-flight streams get ``EngineDeadError``) and its workers."""
        self.client.shutdown()

    # ---- requests in ----------------------------------------------------------------------

    async def _add(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        priority: int,
        cache_salt: str | None,
        lora_request: LoRARequest | None = None,
        sink: str | None = None,
    ) -> _Stream:
        if self._dead is not None:
            raise self._dead
        check_request_id_unused(request_id, self._streams)
        check_priority(priority)  # before the message: the core's decoder would refuse a str
        priority = int(priority)  # (numpy's integers: msgpack takes ints)
        text, token_ids = _split_prompt(prompt)
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            # The core may be another process: images travel preprocessed (pixels, placeholder
            # ranges), which the front makes with engine.multimodal.processor.
            raise InvalidRequestError(
                "images reach the engine core preprocessed: send the expanded "
                "prompt_token_ids with mm_features (engine.multimodal.processor)",
                param="multi_modal_data",
            )
        request = AddRequest(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
            sink=sink,
            mm_features=list(prompt.get("mm_features") or []) if isinstance(prompt, dict) else [],
        )
        if isinstance(params, PoolingParams):
            request.pooling_params = params
        else:
            request.params = params
        # Registered before the core sees the request: its first delta may arrive before the
        # add's reply does.
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        add = asyncio.ensure_future(self.client.add_request(request))
        self._adding[request_id] = add
        add.add_done_callback(lambda _: self._adding.pop(request_id, None))
        try:
            added = await asyncio.shield(add)
        except asyncio.CancelledError:
            # The caller went away while the core was adding the request: once the add is
            # done, abort it (an abort sent now could overtake the add and find nothing).
            self._streams.pop(request_id, None)
            add.add_done_callback(lambda done: self._abort_if_added(done, request_id))
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        stream.prompt, stream.prompt_token_ids = text, added.prompt_token_ids
        if isinstance(params, SamplingParams):
            stream.start(request_id, text, added.prompt_token_ids, params)
        return stream

    def _abort_if_added(self, add: asyncio.Future[Any], request_id: str) -> None:
        if not add.cancelled() and add.exception() is None:
            with contextlib.suppress(EngineDeadError):
                self.client.abort([request_id])

    # ---- outputs in (any thread) ----------------------------------------------------------

    def _on_step(self, step: StepOutputs) -> None:
        """Fan one step's message out to its requests' streams: one wakeup per event loop."""
        now, wall = time.monotonic(), time.time()
        at = now - max(0.0, wall - step.time)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        for delta in step.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue  # closed by its consumer: the abort's last delta has no reader
            if delta.finished:
                self._streams.pop(delta.request_id, None)
            if delta.steps is not None:  # a head's tally: when each of its steps ended
                steps = [(now - max(0.0, wall - t), n) for t, n in delta.steps]
            else:
                made = delta.num_new_tokens
                steps = [(at, made)] if made else []
            by_loop.setdefault(stream.loop, []).append((stream, (delta, at, steps)))
        for loop, items in by_loop.items():
            _post(loop, items)

    def _on_dead(self, error: EngineDeadError) -> None:
        self._dead = error
        streams, self._streams = self._streams, {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        for stream in streams.values():
            by_loop.setdefault(stream.loop, []).append((stream, error))
        for loop, items in by_loop.items():
            _post(loop, items)


def _weakly(method: Callable[[Any], None]) -> Callable[[Any], None]:
    """``method`` (a bound method) called through a weak reference to its object: nothing
    once the object is gone."""
    ref = weakref.WeakMethod(method)

    def call(arg: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(arg)

    return call


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a prompt as the core takes it; the core validates both."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return prompt.get("prompt"), prompt["prompt_token_ids"]
    if isinstance(prompt, dict):
        return prompt.get("prompt"), None
    if isinstance(prompt, list):
        return None, prompt
    return prompt, None


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[_Stream, Any]]) -> None:
    """Hand items to their streams on the streams' event loop (one wakeup per loop)."""

    def deliver() -> None:
        for stream, item in items:
            stream.queue.put_nowait(item)

    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        deliver()
        return
    # A closed loop raises RuntimeError: nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(deliver)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = ["AsyncLLMEngine", "ChoiceDelta", "EngineStats", "StreamOutput", "merge_deltas"]
