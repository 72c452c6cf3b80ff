"""``EngineCoreLoop``: the engine core (``LLMEngine``: scheduler, block manager, executor) on a
thread of its own, in a busy loop that never waits on an event loop. It trades the messages of
``engine.client.core_messages`` with the front (``AsyncLLMEngine``) that holds the per-request
streams.

    front (event loop)                         core thread (owns the LLMEngine)
    ──────────────────                         ────────────────────────────────
    AddRequest ── add() ──────────────────▶    drain commands (add / abort / call)
    abort(ids) ───────────────────────────▶    step()  ← forward pass
                                               one StepOutputs per step: every request's
    on_step(StepOutputs) ◀─────────────────    new tokens, text, logprobs, finishes

The same loop runs in-process (``engine.client.core_client.InProcessCoreClient``) and in the head
actor of a Serve replica (``cluster.serving.head_actor``), where the ``StepOutputs`` cross a process
boundary as msgspec bytes: one message per step for all requests, never one per request.

Every request is added with ``output_kind=DELTA``: the engine itself hands out only what is
new (``engine.core.output_processor``): a choice's text is held back by ``max(len(stop)) - 1``
characters while a stop string could still match, so the concatenated deltas of a choice are
exactly its final text, and a step that produced tokens yields a delta even when their text
is empty (an incomplete UTF-8 character, a special token): token ids, logprobs and usage move
on and clients see steady inter-token timing. Nothing here copies a request's whole output.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from engine import envs
from engine.client.core_messages import (
    CONTROLS,
    AddRequest,
    AddResult,
    ChoiceDelta,
    CoreLoad,
    CoreStats,
    RequestDelta,
    StepOutputs,
)
from engine.core.llm_engine import EngineOutput, LLMEngine
from engine.errors import EngineDeadError, check_request_id_unused
from engine.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("llm_cluster.core_loop")

T = TypeVar("T")


# ---- per-request delta tracking (core thread) ---------------------------------------------------


class _ChoiceTracker:
    """One choice's count of tokens so far (``ChoiceDelta.num_tokens``)."""

    __slots__ = ("index", "num_tokens")

    def __init__(self, index: int) -> None:
        self.index = index
        self.num_tokens = 0

    def delta(self, completion: CompletionOutput) -> ChoiceDelta:
        self.num_tokens += len(completion.token_ids)
        return ChoiceDelta(
            index=self.index,
            text=completion.text,
            token_ids=completion.token_ids,
            logprobs=completion.logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=_stop_reason(completion.stop_reason) if completion.finished else None,
            num_tokens=self.num_tokens,
            cumulative_logprob=completion.cumulative_logprob,
        )


class _RequestTracker:
    """Turns a request's ``DELTA`` outputs (the engine holds stop-string text back and sends
    prompt logprobs once) into the wire's ``RequestDelta``."""

    __slots__ = ("choices",)

    def __init__(self, params: SamplingParams) -> None:
        self.choices = [_ChoiceTracker(i) for i in range(params.n)]

    def delta(self, output: EngineOutput) -> RequestDelta | None:
        if not isinstance(output, RequestOutput):
            raise TypeError(f"{output.request_id!r}: a generation request got a pooling output")
        choices = [self.choices[c.index].delta(c) for c in output.outputs]
        if not (choices or output.finished):
            return None
        return RequestDelta(
            request_id=output.request_id,
            choices=choices,
            finished=output.finished,
            num_cached_tokens=output.num_cached_tokens,
            prompt_logprobs=output.prompt_logprobs,
            kv_transfer_params=output.kv_transfer_params,
        )


class _PoolingTracker:
    """A pooling request: its one output (the vector, or none after an abort) is its delta."""

    __slots__ = ()

    def delta(self, output: EngineOutput) -> RequestDelta | None:
        if not isinstance(output, PoolingRequestOutput):
            raise TypeError(f"{output.request_id!r}: a pooling request got a generation output")
        return RequestDelta(
            request_id=output.request_id,
            choices=[],
            finished=True,
            num_cached_tokens=output.num_cached_tokens,
            embedding=output.outputs.data if output.outputs is not None else None,
        )


def _stop_reason(reason: Any) -> int | str | None:
    return reason if isinstance(reason, (int, str)) else None


# ---- the loop -----------------------------------------------------------------------------------


class EngineCoreLoop:
    """Runs an ``LLMEngine`` on its own thread. ``on_step`` receives each step's ``StepOutputs``
    (on the core thread: it must only hand them on); ``on_dead`` is called once, with the error,
    when the loop stops for good (a failed step, or ``shutdown``). Every ``LLMEngine`` call
    happens on the core thread, so the engine needs no locks. Commands are drained before every
    step, so an abort takes effect within one step and its blocks are free before the next
    forward pass. ``idle_wait_s`` bounds how long the idle thread sleeps between checks of the
    stop flag.

    ``engine`` is best a factory: the engine is then built on the core thread, which is the
    thread that runs its forward passes. On CPU that is worth ~25 % of throughput: a model built
    on one thread and run on another ran at 0.75x (BENCHMARKS.md, "Serving path")."""

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        on_step: Callable[[StepOutputs], None],
        on_dead: Callable[[EngineDeadError], None],
        *,
        idle_wait_s: float = 0.5,
    ) -> None:
        self._on_step = on_step
        self._on_dead = on_dead
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._trackers: dict[str, _RequestTracker | _PoolingTracker] = {}
        self._dead: EngineDeadError | None = None
        self._stopping = False
        self._num_steps = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        # Watchdog: a step running longer than this makes the engine unhealthy (a hung
        # forward pass or collective must not leave a replica that answers health checks).
        self.stall_timeout_s = envs.step_timeout_s()
        self._step_started: float | None = None
        self.engine: LLMEngine
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(engine,), name="llm-engine-core", daemon=True
        )
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    # ---- thread-safe API ----------------------------------------------------------------

    def add(self, request: AddRequest) -> concurrent.futures.Future[AddResult]:
        """Validate and enqueue on the core thread; the future raises ``InvalidRequestError``
        / ``EngineOverloadedError`` (nothing enqueued) or ``EngineDeadError``."""
        return self.submit(lambda: self._add_now(request))

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); each one's last delta says
        finish_reason "abort"."""
        if self._dead is None and not self._stopping:
            self.submit(lambda: self._abort_now(request_ids))

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the core thread between steps."""
        return self.submit(lambda: fn(self.engine))

    def control(self, name: str, args: tuple[Any, ...]) -> concurrent.futures.Future[Any]:
        """One of the engine's ``CONTROLS`` (sleep, wake_up, ...) on the core thread."""
        if name not in CONTROLS:
            raise ValueError(f"control: one of {CONTROLS}, got {name!r}")
        return self.call(lambda engine: getattr(engine, name)(*args))

    def stats(self) -> concurrent.futures.Future[CoreStats]:
        return self.submit(self._stats_now)

    def request_state(self) -> concurrent.futures.Future[dict[str, Any]]:
        """Per-request state still held, taken between steps: the head's tables (this loop's
        trackers, the engine's, scheduler's and block manager's) and each worker's. Every
        count is 0 once the engine is idle; anything else is a leak."""

        def take() -> dict[str, Any]:
            head = self.engine.request_state_sizes()
            head["trackers"] = len(self._trackers)
            workers = self.engine.executor.collective_rpc("num_request_states")
            return {"head": head, "workers": workers}

        return self.submit(take)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._dead is not None:
            future.set_exception(self._dead)
        elif self._stopping:
            future.set_exception(EngineDeadError("the engine is shut down"))
        else:
            self._commands.put(_Command(fn, future))
            if self._dead is not None:  # the loop died between the check and the put: its
                self._fail_commands(self._dead)  # last drain may have missed this command
        return future

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the loop failed or stalled, or a worker is gone."""
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
        """Stop the loop (its requests get ``EngineDeadError`` through ``on_dead``) and the
        workers."""
        if self._stopping:
            return
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout_s)

    # ---- core thread --------------------------------------------------------------------

    def _run(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        try:
            self.engine = engine() if callable(engine) else engine
        except BaseException as exc:
            self._build_error = exc
            return
        finally:
            self._built.set()
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
            self._trackers.clear()
            self._fail_commands(self._dead)
            self._on_dead(self._dead)
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
        deltas = []
        for output in outputs:
            tracker = self._trackers.get(output.request_id)
            if tracker is None:
                continue
            delta = tracker.delta(output)
            if output.finished:
                del self._trackers[output.request_id]
            if delta is not None:
                self._generation_tokens += delta.num_new_tokens
                deltas.append(delta)
        if deltas:
            self._on_step(StepOutputs(deltas, time.time()))

    def _add_now(self, request: AddRequest) -> AddResult:
        check_request_id_unused(request.request_id, self._trackers)
        prompt: Any = request.prompt
        if request.prompt_token_ids is not None:
            prompt = {"prompt_token_ids": request.prompt_token_ids, "prompt": request.prompt}
            if request.mm_features:
                prompt["mm_features"] = request.mm_features
        pooling = request.pooling_params
        # Deltas straight from the engine: no step copies a request's whole output.
        params = (
            request.params.clone(output_kind=RequestOutputKind.DELTA) if pooling is None else None
        )
        added = self.engine.add_request(
            request.request_id,
            prompt,
            pooling if pooling is not None else params,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_request=request.lora_request,
        )
        # Made only once the engine has checked ``n`` against its caps: a tracker keeps one
        # entry per choice, and a client's n of 10**12 must be a 400, not a hang.
        self._trackers[request.request_id] = (
            _PoolingTracker() if pooling is not None else _RequestTracker(request.params)
        )
        self._prompt_tokens += added.num_prompt_tokens
        return AddResult(list(added.prompt_token_ids))

    def _abort_now(self, request_ids: list[str]) -> None:
        """Abort on the core thread: blocks are freed now; each stream ends with "abort"."""
        live = [rid for rid in request_ids if rid in self._trackers]
        if not live:
            return
        deltas = []
        for output in self.engine.abort_request(live):
            tracker = self._trackers.pop(output.request_id, None)
            delta = tracker.delta(output) if tracker is not None else None
            if delta is not None:
                deltas.append(delta)
        for rid in live:
            self._trackers.pop(rid, None)
        if deltas:
            self._on_step(StepOutputs(deltas, time.time()))

    def _stats_now(self) -> CoreStats:
        engine = self.engine
        kv = engine.get_kv_cache_stats()
        counters = engine.counters()
        spec = engine.spec_decode_stats
        return CoreStats(
            num_running=counters.num_running,
            num_waiting=counters.num_waiting,
            kv_total_blocks=kv.total,
            kv_free_blocks=kv.free,
            kv_usage=kv.usage,
            prefix_cache_queries=counters.prefix_cache_queries,
            prefix_cache_hits=counters.prefix_cache_hits,
            external_prefix_cache_queries=counters.external_prefix_cache_queries,
            external_prefix_cache_hits=counters.external_prefix_cache_hits,
            num_preemptions=counters.num_preemptions,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            num_steps=self._num_steps,
            moe_expert_tokens=engine.executor.expert_load(),
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=list(spec.accepted_per_pos),
            cores=[
                CoreLoad(c.num_running, c.num_waiting, usage) for c, usage in engine.core_loads()
            ],
        )

    def _fail_commands(self, error: EngineDeadError) -> None:
        # Commands queued behind the failure never run; their awaiters get the error.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None:
                command.fail(error)


class _Command:
    """A function for the core thread, with the future its caller waits on."""

    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[], Any], future: concurrent.futures.Future[Any]) -> None:
        self.fn = fn
        self.future = future

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:
            self.future.set_exception(exc)

    def fail(self, error: BaseException) -> None:
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)


__all__ = ["EngineCoreLoop"]
