"""``AsyncLLMEngine``: the ``LLMEngine`` behind an asyncio API, for servers.

    event loop (HTTP / gRPC handlers)            engine thread (owns the LLMEngine)
    ─────────────────────────────────            ──────────────────────────────────
    generate() ── add command ──────────────▶    drain commands (add / abort / call)
      ▲  awaits the add's future (errors here)   step()  ← forward pass, off the event loop
      │                                          post outputs ─┐
      └──── per-request asyncio.Queue ◀──── call_soon_threadsafe┘

Every ``LLMEngine`` call happens on the one engine thread, so the engine needs no locks; the
event loop only ever waits on futures and queues. Commands are drained before every step, so an
abort (a cancelled stream, a disconnected client) takes effect within one step and its blocks
are free before the next forward pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine import envs
from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError
from engine.llm_engine import LLMEngine, PromptType
from engine.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from engine.sampling_params import SamplingParams

logger = logging.getLogger("llm_cluster.async_engine")

T = TypeVar("T")


@dataclass(frozen=True)
class ChoiceDelta:
    """What is new for one of a request's n choices since the previous item of its stream."""

    index: int
    text: str
    token_ids: list[int]
    # One entry per new token (token id -> Logprob, the sampled token first) when the request
    # asked for logprobs; aligned with ``token_ids``.
    logprobs: SampleLogprobs | None
    # Set on the one delta in which this choice finishes.
    finish_reason: str | None
    stop_reason: int | str | None
    num_tokens: int  # this choice's tokens so far


@dataclass(frozen=True)
class StreamOutput:
    """One item of a request's stream: the cumulative ``RequestOutput`` plus, per choice that
    has something new, its delta (``deltas``, ordered by index). Concatenating a choice's delta
    texts gives its final text exactly: while stop strings could still match, its last
    ``max(len(stop)) - 1`` characters are held back."""

    output: RequestOutput
    deltas: list[ChoiceDelta]
    # Monotonic time of the step that produced the newest token in this item.
    time: float = field(default=0.0)

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


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken on the engine thread between steps."""

    num_running: int
    num_waiting: int
    kv_total_blocks: int
    kv_free_blocks: int
    kv_usage: float  # fraction of blocks held by requests, in [0, 1]
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_steps: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class _ChoiceTracker:
    """How much of one choice its stream has sent: text (held back near stop strings), tokens,
    and whether its finish was reported."""

    def __init__(self, index: int, holdback: int) -> None:
        self.index = index
        self.holdback = holdback
        self.sent_text = ""
        self.sent_tokens = 0
        self.sent_finish = False

    def delta(self, completion: CompletionOutput) -> ChoiceDelta | None:
        text = completion.text
        if not completion.finished and self.holdback:
            text = text[: max(len(self.sent_text), len(text) - self.holdback)]
        delta_text = text[len(self.sent_text) :]
        new_tokens = completion.token_ids[self.sent_tokens :]
        finishing = completion.finished and not self.sent_finish
        if not (delta_text or new_tokens or finishing):
            return None
        logprobs = completion.logprobs
        delta = ChoiceDelta(
            index=self.index,
            text=delta_text,
            token_ids=list(new_tokens),
            logprobs=list(logprobs[self.sent_tokens :]) if logprobs is not None else None,
            finish_reason=completion.finish_reason if finishing else None,
            stop_reason=completion.stop_reason if finishing else None,
            num_tokens=len(completion.token_ids),
        )
        self.sent_text, self.sent_tokens = text, len(completion.token_ids)
        self.sent_finish = completion.finished
        return delta


class _Stream:
    """The event-loop side of one request: its loop, a queue of outputs / an exception, and
    what has been sent of each of its choices."""

    def __init__(self, loop: asyncio.AbstractEventLoop, params: SamplingParams) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[RequestOutput, float] | BaseException] = asyncio.Queue()
        holdback = max((len(s) for s in params.stop or []), default=1) - 1
        self.choices = [_ChoiceTracker(i, holdback) for i in range(params.n)]
        self.finished = False

    def delta(self, output: RequestOutput, at: float) -> StreamOutput | None:
        deltas = []
        for completion in output.outputs:
            delta = self.choices[completion.index].delta(completion)
            if delta is not None:
                deltas.append(delta)
        if not (deltas or output.finished):
            return None
        return StreamOutput(output, deltas, at)


class AsyncLLMEngine:
    """An ``LLMEngine`` driven by a background thread; ``generate`` streams outputs.

    ``idle_wait_s`` bounds how long the idle thread sleeps between checks of the stop flag.
    """

    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.5) -> None:
        self.engine = engine
        self.config: EngineConfig = engine.config
        self.tokenizer = engine.tokenizer
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._dead: EngineDeadError | None = None
        self._stopping = False
        self._num_steps = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._num_tokens: dict[str, int] = {}
        # Watchdog: a step running longer than this makes the engine unhealthy (a hung
        # forward pass or collective must not leave a replica that answers health checks).
        self.stall_timeout_s = envs.step_timeout_s()
        self._step_started: float | None = None
        self._thread = threading.Thread(target=self._run, name="llm-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, **engine_args: Any) -> AsyncLLMEngine:
        return cls(LLMEngine(EngineConfig.from_kwargs(**engine_args)))

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
    ) -> AsyncIterator[StreamOutput]:
        """Stream a request's outputs. Raises ``InvalidRequestError`` before anything is
        enqueued when the request is invalid, ``EngineDeadError`` if the engine fails. Closing
        or cancelling the iterator before the last output aborts the request. ``timeout_s``
        (seconds from now) is a deadline: past it the request is aborted, its blocks are freed
        and its stream ends with finish_reason "abort"."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        params = params or SamplingParams()
        if timeout_s is not None and not (_is_number(timeout_s) and timeout_s > 0):
            raise InvalidRequestError(f"must be > 0 seconds, got {timeout_s!r}", param="timeout")
        stream = await self._add(request_id, prompt, params, priority, cache_salt)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s is not None else None
        try:
            while True:
                try:
                    remaining = deadline - loop.time() if deadline is not None else None
                    item = await asyncio.wait_for(stream.queue.get(), remaining)
                except TimeoutError:
                    # Past the deadline: the abort's final output arrives on the queue.
                    deadline = None
                    await self._call(lambda: self._abort_now(request_id))
                    continue
                items = [item]
                # Coalesce what piled up while the consumer was busy into one item.
                while not stream.queue.empty():
                    items.append(stream.queue.get_nowait())
                error = next((i for i in items if isinstance(i, BaseException)), None)
                if error is not None:
                    stream.finished = True
                    raise error
                output, at = items[-1]
                stream.finished = output.finished
                delta = stream.delta(output, at)
                if delta is not None:
                    yield delta
                if output.finished:
                    return
        finally:
            if not stream.finished:
                self._submit(lambda: self._abort_now(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort"."""
        await self._call(lambda: self._abort_now(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        return await self._call(lambda: fn(self.engine))

    async def get_stats(self) -> EngineStats:
        return await self._call(self._stats_now)

    async def request_state(self) -> dict[str, Any]:
        """Per-request state still held, taken between steps: the head's tables (this class's
        streams, the engine's and scheduler's and block manager's) and each worker's. Every
        count is 0 once the engine is idle; anything else is a leak."""

        def take() -> dict[str, Any]:
            head = self.engine.request_state_sizes()
            head["streams"] = len(self._streams)
            head["token_counts"] = len(self._num_tokens)
            workers = self.engine.executor.collective_rpc("num_request_states")
            return {"head": head, "workers": workers}

        return await self._call(take)

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine failed or its thread is gone."""
        if self._dead is not None:
            raise self._dead
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread has stopped")
        started = self._step_started
        if started is not None and time.monotonic() - started > self.stall_timeout_s:
            raise EngineDeadError(
                f"an engine step has run for {time.monotonic() - started:.0f} s, over the "
                f"{self.stall_timeout_s:.0f} s limit (LLM_CLUSTER_STEP_TIMEOUT_S): stalled"
            )
        self.engine.executor.check_health()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None or not self._thread.is_alive()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread (in-flight streams get ``EngineDeadError``) and the workers."""
        if self._stopping:
            return
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout_s)

    # ---- event loop -> engine thread ----------------------------------------------------

    async def _add(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
    ) -> _Stream:
        loop = asyncio.get_running_loop()

        def add() -> _Stream:
            if request_id in self._streams:
                raise InvalidRequestError(f"{request_id!r} is already in use", param="request_id")
            request = self.engine.add_request(
                request_id, prompt, params, priority=priority, cache_salt=cache_salt
            )
            # Made only once the engine has checked ``n`` against its caps: the stream keeps one
            # tracker per choice, and a client's n of 10**12 must be a 400, not a hang.
            stream = _Stream(loop, params)
            self._streams[request_id] = stream
            self._num_tokens[request_id] = 0
            self._prompt_tokens += request.num_prompt_tokens
            return stream

        return await self._call(add)

    async def _call(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._submit(fn, future)
        return await asyncio.wrap_future(future)

    def _submit(
        self, fn: Callable[[], Any], future: concurrent.futures.Future[Any] | None = None
    ) -> None:
        if self._dead is not None:
            raise self._dead
        if self._stopping:
            raise EngineDeadError("the engine is shut down")
        self._commands.put(_Command(fn, future))

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._drain_commands():
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:
            logger.exception("engine loop failed")
            self._dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(str(exc))
            self._dead.__cause__ = exc
        finally:
            if self._dead is None:
                self._dead = EngineDeadError("the engine is shut down")
            self._fail_everything(self._dead)
            self.engine.shutdown()

    def _drain_commands(self) -> bool:
        """Run queued commands; block while there is no work. False when asked to stop."""
        block = not self.engine.has_unfinished_requests()
        while True:
            try:
                command = self._commands.get(
                    block=block, timeout=self._idle_wait_s if block else None
                )
            except queue.Empty:
                if self._stopping:
                    return False
                if block and not self.engine.has_unfinished_requests():
                    continue
                return True
            if command is None:
                return False
            command.run()
            block = False

    def _step(self) -> None:
        self._step_started = time.monotonic()
        outputs = self.engine.step()
        self._step_started = None
        self._num_steps += 1
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for output in outputs:
            rid = output.request_id
            stream = self._streams.get(rid)
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            self._generation_tokens += num_tokens - self._num_tokens.get(rid, 0)
            self._num_tokens[rid] = num_tokens
            if output.finished:
                self._streams.pop(rid, None)
                self._num_tokens.pop(rid, None)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            _post(loop, [(s, (o, now)) for s, o in items])

    def _abort_now(self, request_id: str) -> None:
        """Abort on the engine thread: blocks are freed now; the stream ends with "abort"."""
        stream = self._streams.pop(request_id, None)
        self._num_tokens.pop(request_id, None)
        outputs = self.engine.abort_request(request_id)
        if stream is not None and outputs:
            _post(stream.loop, [(stream, (outputs[0], time.monotonic()))])

    def _stats_now(self) -> EngineStats:
        engine = self.engine
        kv = engine.get_kv_cache_stats()
        sched = engine.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=sched.num_waiting,
            kv_total_blocks=kv.total,
            kv_free_blocks=kv.free,
            kv_usage=kv.usage,
            prefix_cache_queries=engine.block_manager.prefix_queries,
            prefix_cache_hits=engine.block_manager.prefix_hits,
            num_preemptions=sched.num_preemptions,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            num_steps=self._num_steps,
        )

    def _fail_everything(self, error: EngineDeadError) -> None:
        streams, self._streams = self._streams, {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        for stream in streams.values():
            by_loop.setdefault(stream.loop, []).append((stream, error))
        for loop, items in by_loop.items():
            _post(loop, items)
        # Commands queued behind the failure never run; their awaiters get the error.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None:
                command.fail(error)


class _Command:
    """A function for the engine thread, with the future its caller awaits (if any)."""

    def __init__(
        self, fn: Callable[[], Any], future: concurrent.futures.Future[Any] | None
    ) -> None:
        self.fn = fn
        self.future = future

    def run(self) -> None:
        if self.future is None:
            self.fn()
            return
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:
            self.future.set_exception(exc)

    def fail(self, error: BaseException) -> None:
        if self.future is not None and self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[_Stream, Any]]) -> None:
    """Hand items to their streams on the streams' event loop (one wakeup per loop)."""

    def deliver() -> None:
        for stream, item in items:
            stream.queue.put_nowait(item)

    # A closed loop raises RuntimeError: nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(deliver)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = ["AsyncLLMEngine", "ChoiceDelta", "EngineStats", "StreamOutput"]
