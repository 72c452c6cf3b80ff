"""The head of a model replica as a Ray actor of its own: the engine core (``LLMEngine`` in an
``EngineCoreLoop``) in a process that does nothing else, in the replica's placement group. The
actor's side; the replica (the ``LLMServer`` front) starts and calls it through
``cluster.serving.head_client.HeadCoreClient``. All messages are msgspec.

    LLMServer replica (front)                     HeadActor (own process)
    ──────────────────────────                    ───────────────────────
    add_request(AddRequest bytes) ─────────────▶  validate on the core thread → AddReply
    abort([ids]) ──────────────────────────────▶  (fire and forget)
    poll(acked) ◀── list[StepOutputs] bytes ───   every step's outputs after ``acked``

    ingress replica (a ``TokenChannel``)
    ────────────────────────────────────
    its TCP listener ◀── list[StepOutputs] ─────  the steps' deltas of the requests added with
                                                  ``AddRequest.sink == sink``, nothing else,
                                                  written by a ``SinkPusher`` (``token_push``)

Owned by the replica, so it dies with it; if the head dies, every stream ends with a 503 and
Serve replaces the replica. ``LLM_CLUSTER_HEAD_CORE_PROCESS=1`` (TP = PP = 1) runs the core in
a child process (``engine.client.core_process``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from typing import Any

import msgspec
import ray

from cluster.runtime.load_progress import LoadProgressPublisher, ProgressStore
from cluster.serving.front_tally import HeldTally, first_tally
from cluster.serving.head_messages import AddReply, CoreError, PollReply
from cluster.serving.start_errors import known_start_failure
from cluster.serving.token_push import SinkPusher
from engine import envs
from engine.client.core_loop import EngineCoreLoop
from engine.client.core_messages import (
    AddRequest,
    ControlReply,
    RequestDelta,
    StepOutputs,
    encode_steps,
)
from engine.client.core_process import EngineCoreProcess, EngineStartFailed, run_in_child_process
from engine.config import EngineConfig
from engine.core.data_parallel import build_engine
from engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStateError,
    InvalidRequestError,
)
from engine.startup_timeline import StartupTimeline
from engine.worker.executor import PHASE_READY, StartupObserver, get_executor_class

logger = logging.getLogger("llm_cluster.head")

HEAD_NAME_PREFIX = "LLMHead:"
_POLL_WAIT_S = 1.0


_ADD_DECODER = msgspec.msgpack.Decoder(AddRequest)


_ENCODER = msgspec.msgpack.Encoder()


class _Outbox:
    """Steps not yet acknowledged by one reader, oldest first, numbered from ``first_seq``.
    ``cond`` (over the head's one lock) wakes only this outbox's reader: a step for one reader
    does not wake the others (each wakeup takes the GIL from the core thread)."""

    __slots__ = ("cond", "first_seq", "steps")

    def __init__(self, lock: threading.Lock) -> None:
        self.cond = threading.Condition(lock)
        self.steps: list[StepOutputs] = []
        self.first_seq = 1

    def ack(self, acked: int) -> None:
        drop = max(0, min(acked - self.first_seq + 1, len(self.steps)))
        del self.steps[:drop]
        self.first_seq += drop

    def reply(self, dead: str | None) -> bytes:
        last_seq = self.first_seq + len(self.steps) - 1
        return _ENCODER.encode(PollReply(encode_steps(list(self.steps)), last_seq, dead))


class HeadActor:
    """Ray actor (threaded): the engine core of one model replica.

    Polling: one poll is always outstanding; it returns as soon as a step has produced
    something, with every step the front has not acknowledged (one message for all requests,
    however many steps piled up). Steps are numbered; the next poll acknowledges what the last
    one returned, so a poll whose reply is lost (its caller's event loop ended) loses nothing.
    The core thread never waits for the front. The front makes every call to the head outside
    any request's context: Serve cancels the Ray calls a request made when the request is
    cancelled, and the poll and an abort are not the request's own.

    Sinks: a request added with a ``sink`` (the ingress's ``cluster.serving.token_channel``,
    ``tcp://HOST:PORT/TOKEN``) has its deltas put in that sink's outbox: one message per step
    for all of that ingress's requests, instead of one Serve stream item per request per step
    through the replica. A ``SinkPusher`` connects to that ingress and the core thread writes
    each step to it (``cluster.serving.token_push``), with no Ray call and no other thread
    woken per step; the sink lives as long as its connection. Its front, whose stream then
    carries no tokens, gets only tallies: at the request's first delta and its last, each
    choice's finish and token count and each step's time (``RequestDelta.steps``, for the
    latency metrics), never its text or tokens: one wakeup of the replica per request, not per
    step, and the output is shaped once, at the ingress.

    Failure: the actor is owned by the replica, so it dies with it; if the head dies, the poll
    fails, every stream ends with a 503 and the replica's health check fails, so Serve replaces
    it.

    Start-up has no deadline here: the engine's executor bounds each start-up phase by
    ``LLM_CLUSTER_LOAD_TIMEOUT_S`` and the front waits for ``ready`` as long as that takes (the
    core loop's stall watchdog only times steps). The in-process worker of a TP = PP = 1 head
    publishes its load progress like a worker actor does (``cluster.runtime.load_progress``),
    and the head logs the start-up timeline once the engine runs.

    With a core process (TP = PP = 1), the engine core runs in a plain child process (a socket
    pair, msgpack) rather than on the actor's thread, as vLLM's EngineCore runs inside a Ray
    Serve LLM replica, and the actor only relays; off by default (BENCHMARKS.md, "After delta
    outputs; the engine core in a child process").
    """

    def __init__(
        self, engine_args: dict[str, Any], model_id: str = "", core_process: bool | None = None
    ) -> None:
        """``core_process``: run the engine core in a child process (TP = PP = 1 only); None
        reads ``LLM_CLUSTER_HEAD_CORE_PROCESS``."""
        started = time.monotonic()
        name = ray.get_runtime_context().get_actor_name() or "head"
        # "head <model> <replica id>": the replica's timeline is "replica <model> <replica id>".
        timeline = StartupTimeline(
            f"head {model_id} {name.rpartition(':')[2]}", from_process_start=True
        )
        timeline.mark("imports")  # a prestarted worker's wait for this actor, then its imports
        config = EngineConfig.from_kwargs(**engine_args)
        timeline.mark("config")
        self._lock = threading.Lock()  # guards the outboxes and the routes below
        self._outbox = _Outbox(self._lock)  # the front's
        self._sinks: dict[str, _Outbox] = {}  # ingress channels', by sink name
        self._sink_of: dict[str, str] = {}  # request id -> its sink, until its last delta
        # A sink request's deltas after its first, held back from the front until its last.
        self._held: dict[str, HeldTally] = {}
        self._pushers: dict[str, SinkPusher] = {}  # the sinks' writers, by sink name
        self._name = name
        self._dead: str | None = None
        self._start_failure: str | None = None
        observer = PublishingObserver(
            model_id or config.model.model_path,
            uuid.uuid4().hex[:12],
            ray.util.get_node_ip_address(),
        )
        self._loop: EngineCoreLoop | EngineCoreProcess
        try:
            if core_process is None:
                core_process = envs.head_core_process()
            if core_process and run_in_child_process(config):
                self._loop = EngineCoreProcess(
                    engine_args, self._push, self._died, observer=observer,
                    classify="cluster.serving.start_errors:known_start_failure",
                )  # fmt: skip
                busy_s, summary = self._loop.startup_busy_s, self._loop.startup_summary
            else:
                # The engine builds its executor as ``executor_class(config)``: the observer
                # rides along.
                executor_class = functools.partial(get_executor_class(config), observer=observer)
                # Built on the core thread, which runs its forward passes (see EngineCoreLoop).
                self._loop = EngineCoreLoop(
                    lambda: build_engine(config, executor_class),
                    self._push,
                    self._died,
                )
                executor = self._loop.engine.executor
                busy_s = sum(executor.startup_timings.values())
                summary = executor.startup_summary()
            timeline.mark("engine")
            _log_startup(observer.model_id, started, summary, busy_s)
            timeline.log(logger)
        except Exception as exc:
            # A known cause is returned by ``ready`` as one line: an actor that dies in its
            # constructor leaves its caller only Ray's text of the traceback.
            if isinstance(exc, EngineStartFailed):
                self._start_failure = exc.known
            else:
                self._start_failure = known_start_failure(exc)
            if self._start_failure is None:
                raise
            logger.exception("the engine cannot start: %s", self._start_failure)
        finally:
            observer.close()  # ready, or failed: either way nothing is loading any more

    def ready(self) -> str | None:
        """None once the engine runs; else why it cannot start (a known cause, one line: this
        actor then serves nothing and its owner kills it)."""
        return self._start_failure

    def add_request(self, data: bytes) -> bytes:
        request: AddRequest | None = None
        try:
            request = _ADD_DECODER.decode(data)
            if request.sink is not None:
                self._route_to_sink(request.request_id, request.sink)
            reply = AddReply(result=self._loop.add(request).result())
        except msgspec.ValidationError as exc:
            reply = AddReply(error=CoreError("invalid", f"malformed request: {exc}"))
        except (InvalidRequestError, EngineOverloadedError, EngineStateError,
                EngineDeadError) as exc:  # fmt: skip
            reply = AddReply(error=CoreError.of(exc))
        except Exception as exc:  # this request's alone: raising would read as a dead head
            logger.exception("taking request %s failed", request and request.request_id)
            reply = AddReply(error=CoreError.of(exc))
        if reply.error is not None and request is not None and request.sink is not None:
            with self._lock:
                if self._sink_of.get(request.request_id) == request.sink:
                    del self._sink_of[request.request_id]
                    self._held.pop(request.request_id, None)
        return _ENCODER.encode(reply)

    def _route_to_sink(self, request_id: str, sink: str) -> None:
        """Before the core sees the request (its first delta may come at once): its deltas go
        to ``sink`` too, whose ``SinkPusher`` connects on the sink's first request."""
        with self._lock:
            box = self._sinks.setdefault(sink, _Outbox(self._lock))
            self._sink_of[request_id] = sink
            if sink not in self._pushers:
                self._pushers[sink] = SinkPusher(
                    sink, self._name, box, box.cond, lambda: self._dead, self._drop_sink
                )

    def _drop_sink(self, sink: str) -> None:
        """A sink's connection ended (its ingress is gone): forget it and its requests'
        routes; the requests themselves end when Serve cancels their calls."""
        with self._lock:
            self._pushers.pop(sink, None)
            self._sinks.pop(sink, None)
            for rid in [r for r, s in self._sink_of.items() if s == sink]:
                del self._sink_of[rid]
                self._held.pop(rid, None)

    def abort(self, request_ids: list[str]) -> None:
        self._loop.abort(list(request_ids))

    def poll(self, acked: int, wait_s: float = _POLL_WAIT_S) -> bytes:
        """Drop the steps up to ``acked`` (the front has them), then return every later one;
        waits up to ``wait_s`` for one."""
        box = self._outbox
        with self._lock:
            box.ack(acked)
            box.cond.wait_for(lambda: box.steps or self._dead is not None, wait_s)
            return box.reply(self._dead)

    def wait_sink_acked(self, sink: str, wait_s: float) -> bool:
        """Wait up to ``wait_s`` until the ingress has acknowledged everything in ``sink``'s
        outbox (True), e.g. the last deltas of requests a draining replica aborted: the replica
        (and this actor with it) must not stop before its ingress has them."""
        with self._lock:
            pusher = self._pushers.get(sink)
            if pusher is None:
                return True
            pusher.request_ack()
            cond = self._sinks[sink].cond
            return cond.wait_for(lambda: pusher.synced() or self._dead is not None, wait_s)

    def stats(self) -> bytes:
        return _ENCODER.encode(self._loop.stats().result())

    def request_state(self) -> bytes:
        return _ENCODER.encode(self._loop.request_state().result())

    def control(self, name: str, args: list[Any]) -> bytes:
        """``EngineCoreLoop.control``: a ``ControlReply``."""
        try:
            reply = ControlReply(value=self._loop.control(name, tuple(args)).result())
        except (InvalidRequestError, EngineStateError, EngineDeadError) as exc:
            reply = ControlReply(error=CoreError.of(exc))
        return _ENCODER.encode(reply)

    def check_health(self) -> str | None:
        """None when healthy, else why not (the core loop, its watchdog, the workers; the
        core's process, when it has one)."""
        try:
            self._loop.check_health()
        except EngineDeadError as exc:
            return str(exc)
        except TimeoutError:
            return "the engine core process did not answer a health check"
        return None

    def shutdown(self) -> None:
        self._loop.shutdown()
        with self._lock:
            pushers = list(self._pushers.values())
        for pusher in pushers:
            pusher.close()

    # ---- core thread --------------------------------------------------------------------

    def _push(self, step: StepOutputs) -> None:
        with self._lock:
            front = step
            if self._sink_of:
                front = StepOutputs([], step.time)
                by_sink: dict[str, list[RequestDelta]] = {}
                for delta in step.deltas:
                    sink = self._sink_of.get(delta.request_id)
                    if sink is None:
                        front.deltas.append(delta)
                        continue
                    by_sink.setdefault(sink, []).append(delta)
                    for_front = self._for_front(delta, step.time)
                    if for_front is not None:
                        front.deltas.append(for_front)
                    if delta.finished:
                        del self._sink_of[delta.request_id]
                for sink, deltas in by_sink.items():
                    # A routed request's sink has its outbox and pusher (both go in _drop_sink).
                    self._sinks[sink].steps.append(StepOutputs(deltas, step.time))
                    self._pushers[sink].pushed()  # written by this (the core) thread, if it can
            if front.deltas:
                self._outbox.steps.append(front)
                self._outbox.cond.notify_all()

    def _for_front(self, delta: RequestDelta, at: float) -> RequestDelta | None:
        """What the front gets of a sink request's delta: its tallies, not its tokens (the
        sink renders those). The first delta goes at once (the first token's time, the prompt's
        logprobs); the others are held and the last goes with every held step's time and token
        count: one wakeup of the front per request rather than per step."""
        held = self._held.get(delta.request_id)
        if held is None:
            first = first_tally(delta, at)
            if not delta.finished:
                self._held[delta.request_id] = HeldTally(first)
            return first
        held.add(delta, at)
        if not delta.finished:
            return None
        del self._held[delta.request_id]
        return held.last(delta)

    def _died(self, error: EngineDeadError) -> None:
        with self._lock:
            self._dead = str(error) or "the engine failed"
            self._outbox.cond.notify_all()
            for pusher in self._pushers.values():
                pusher.pushed()  # its last frame says why; wakes its outbox's waiters


class PublishingObserver(StartupObserver):
    """The executor's ``StartupObserver`` for workers in this process (the head's own worker at
    TP = PP = 1): each rank's record published like a worker actor's; ``PHASE_READY`` or
    ``close`` removes them."""

    def __init__(
        self, model_id: str, executor_id: str, node: str, store: ProgressStore | None = None
    ) -> None:
        super().__init__(model_id)
        self.executor_id = executor_id
        self.node = node
        self._store = store
        self._publishers: dict[int, LoadProgressPublisher] = {}

    def _publisher(self, rank: int) -> LoadProgressPublisher:
        if rank not in self._publishers:
            self._publishers[rank] = LoadProgressPublisher(
                self.model_id, self.executor_id, rank, self.node, store=self._store
            )
        return self._publishers[rank]

    def phase(self, rank: int, phase: str) -> None:
        if phase == PHASE_READY:
            self._publisher(rank).close()
        else:
            self._publisher(rank).phase(phase)

    def weights(self, rank: int, read_bytes: int, total_bytes: int) -> None:
        self._publisher(rank).weights(read_bytes, total_bytes)

    def close(self) -> None:
        for publisher in self._publishers.values():
            publisher.close()


def _log_startup(model_id: str, started: float, summary: str, busy_s: float) -> None:
    """``model m: engine ready in 214.0 s (placement 0.3 s, workers 2.1 s, load 201.5 s,
    KV sizing 3.2 s, cache/graphs 6.0 s, other 0.9 s)``; other: config, tokenizer, a child
    process's start, …"""
    total = time.monotonic() - started
    logger.info(
        "model %s: engine ready in %.1f s (%s, other %.1f s)", model_id, total, summary,
        total - busy_s,
    )  # fmt: skip


def model_id_of_head(name: str) -> str:
    """The model id in a head actor's name ``LLMHead:<model id>:<replica id>``."""
    return name.removeprefix(HEAD_NAME_PREFIX).rpartition(":")[0] or name


__all__ = [
    "HEAD_NAME_PREFIX",
    "HeadActor",
]
