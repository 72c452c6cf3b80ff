"""``EngineCoreProcess``: an ``EngineCoreLoop`` in a plain child process, driven over a socket
pair, with the same thread-safe API as the loop itself (``add``, ``abort``, ``stats``,
``request_state``, ``check_health``, ``shutdown``). vLLM runs its ``EngineCore`` the same way
inside a Ray Serve replica.

    parent (e.g. a Serve replica's head actor)        child (``python -m
    engine.client.core_process``) ──────────────────────────────────────────
    ───────────────────────────────────────── add / abort / stats / state / health ── cmd ──▶   main
    thread: reads commands, hands them to
                                                      the loop, answers health itself
    reader thread ◀── step / reply / dead ───────     core thread: builds the engine, steps,
       on_step(StepOutputs), futures, on_dead          sends one message per step

Why a process: in a Ray worker the engine's forward pass shares its process with Ray's own
threads (a signal check on the main thread every 10 ms that takes the GIL, the core worker's
poll threads, the actor's method threads), and on CPU every wakeup that preempts one of the
forward's OpenMP threads stalls the others at their next barrier. The child holds only the
engine: its main thread sleeps in ``recv`` and wakes only for commands.

Every message is msgpack (msgspec) over ``multiprocessing.connection`` framing; the child
gets the engine's keyword arguments, never a pickle. The child ends when the parent's end of
the socket closes (the parent exited or was killed), so no engine outlives its owner. Where
the engine's executor starts Ray workers (TP or PP > 1), the child would have to join Ray as a
driver of its own; ``run_in_child_process`` says which engines can run here.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

from engine.client.core_messages import (
    AddReply,
    AddRequest,
    AddResult,
    CoreError,
    CoreStats,
    StepOutputs,
)
from engine.errors import EngineDeadError

logger = logging.getLogger("llm_cluster.core_process")

# Child → parent kinds.
_STEP, _REPLY, _DEAD, _READY, _FAILED, _PROGRESS = (
    "step",
    "reply",
    "dead",
    "ready",
    "failed",
    "progress",
)
# Parent → child kinds.
_ADD, _ABORT, _STATS, _STATE, _HEALTH, _STOP = "add", "abort", "stats", "state", "health", "stop"
_CONTROL = "control"


class _Message(msgspec.Struct, array_like=True):
    kind: str
    id: int = 0
    data: Any = None  # raw msgpack bytes for structs, plain values otherwise


class _Failure(msgspec.Struct, array_like=True):
    known: str | None  # the classifier's one-line reason, when the cause is known
    text: str  # the child's traceback


class _Ready(msgspec.Struct, array_like=True):
    summary: str  # the executor's start-up summary
    busy_s: float  # the sum of its timed start-up phases


_ENCODER = msgspec.msgpack.Encoder()
_MESSAGE = msgspec.msgpack.Decoder(_Message)
_STEP_DECODER = msgspec.msgpack.Decoder(StepOutputs)
_ADD_REPLY = msgspec.msgpack.Decoder(AddReply)
_STATS_DECODER = msgspec.msgpack.Decoder(CoreStats)
_FAILURE = msgspec.msgpack.Decoder(_Failure)
_READY_DECODER = msgspec.msgpack.Decoder(_Ready)


class EngineStartFailed(RuntimeError):
    """The child could not build its engine: ``known`` is the classifier's one-line reason
    (None: an unknown cause), the message the child's traceback."""

    def __init__(self, known: str | None, text: str) -> None:
        super().__init__(known or text)
        self.known = known


def run_in_child_process(config: Any) -> bool:
    """Whether this engine can run in a child process: its executor keeps every worker in the
    engine's own process (TP = PP = 1)."""
    return config.parallel.executor_backend == "uni"


class EngineCoreProcess:
    """The parent's side. Blocks in ``__init__`` until the child's engine is ready (its
    start-up phases are relayed to ``observer`` meanwhile) or raises ``EngineStartFailed``.
    ``on_step`` and ``on_dead`` are called on the reader thread.

    ``classify`` is an import path (``module:function``) the child calls on a start-up
    exception to get a one-line reason for a known cause (or None)."""

    def __init__(
        self,
        engine_args: dict[str, Any],
        on_step: Callable[[StepOutputs], None],
        on_dead: Callable[[EngineDeadError], None],
        *,
        observer: Any = None,
        classify: str | None = None,
    ) -> None:
        self._on_step = on_step
        self._on_dead = on_dead
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, concurrent.futures.Future[Any]]] = {}
        self._lock = threading.Lock()  # sends, and ``_pending``
        self._dead: EngineDeadError | None = None
        self._stopping = False
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "engine.client.core_process", str(child.fileno())],
            pass_fds=(child.fileno(),),
            env=env,
        )
        child.close()
        self._conn = Connection(parent.detach())
        self._send(_Message("start", 0, _ENCODER.encode({"engine_args": engine_args,
                                                         "classify": classify})))  # fmt: skip
        try:
            ready = self._wait_ready(observer)
        except BaseException:
            self._kill()
            raise
        self.startup_summary = ready.summary
        self.startup_busy_s = ready.busy_s
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    # ---- the loop's API ---------------------------------------------------------------

    def add(self, request: AddRequest | bytes) -> concurrent.futures.Future[AddResult]:
        data = request if isinstance(request, bytes) else _ENCODER.encode(request)
        return self._call(_ADD, data)

    def abort(self, request_ids: list[str]) -> None:
        if self._dead is None and not self._stopping:
            self._send(_Message(_ABORT, 0, list(request_ids)))

    def stats(self) -> concurrent.futures.Future[CoreStats]:
        return self._call(_STATS)

    def request_state(self) -> concurrent.futures.Future[dict[str, Any]]:
        return self._call(_STATE)

    def control(self, name: str, args: tuple[Any, ...]) -> concurrent.futures.Future[Any]:
        """``EngineCoreLoop.control`` in the child."""
        return self._call(_CONTROL, [name, list(args)])

    def check_health(self, timeout_s: float = 15.0) -> None:
        if self._dead is not None:
            raise self._dead
        if self._proc.poll() is not None:
            raise EngineDeadError(f"the engine core process exited (code {self._proc.returncode})")
        self._call(_HEALTH).result(timeout_s)

    @property
    def is_dead(self) -> bool:
        return self._dead is not None or self._proc.poll() is not None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            self._send(_Message(_STOP))
            self._proc.wait(timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill()

    # ---- internals ----------------------------------------------------------------------

    def _call(self, kind: str, data: Any = None) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self._dead is not None:
            future.set_exception(self._dead)
            return future
        if self._stopping:
            future.set_exception(EngineDeadError("the engine is shut down"))
            return future
        with self._lock:
            call_id = next(self._ids)
            self._pending[call_id] = (kind, future)
        try:
            self._send(_Message(kind, call_id, data))
        except OSError as exc:
            with self._lock:
                self._pending.pop(call_id, None)
            future.set_exception(EngineDeadError(f"the engine core process is gone: {exc}"))
        return future

    def _send(self, message: _Message) -> None:
        data = _ENCODER.encode(message)
        with self._lock:
            self._conn.send_bytes(data)

    def _wait_ready(self, observer: Any) -> _Ready:
        while True:
            try:
                message = _MESSAGE.decode(self._conn.recv_bytes())
            except (EOFError, OSError) as exc:
                code = self._proc.wait()
                raise RuntimeError(
                    f"the engine core process exited during start-up (code {code})"
                ) from exc
            if message.kind == _READY:
                return _READY_DECODER.decode(message.data)
            if message.kind == _FAILED:
                failure = _FAILURE.decode(message.data)
                raise EngineStartFailed(failure.known, failure.text)
            if message.kind == _PROGRESS and observer is not None:
                method, args = message.data
                getattr(observer, method)(*args)

    def _read(self) -> None:
        try:
            while True:
                message = _MESSAGE.decode(self._conn.recv_bytes())
                if message.kind == _STEP:
                    self._on_step(_STEP_DECODER.decode(message.data))
                elif message.kind == _REPLY:
                    self._resolve(message)
                elif message.kind == _DEAD:
                    self._fail(EngineDeadError(message.data))
        except (EOFError, OSError):
            code = self._proc.wait()
            why = "the engine is shut down" if self._stopping else (
                f"the engine core process exited (code {code})")  # fmt: skip
            self._fail(EngineDeadError(why))
        except BaseException as exc:  # a bug here must not leave requests hanging
            logger.exception("engine core reader failed")
            self._fail(EngineDeadError(f"the engine core reader failed: {exc}"))
            self._kill()

    def _resolve(self, message: _Message) -> None:
        with self._lock:
            kind, future = self._pending.pop(message.id, (None, None))
        if future is None:
            return
        ok, data = message.data
        if not ok:
            future.set_exception(msgspec.msgpack.decode(data, type=CoreError).exception())
        elif kind == _ADD:
            reply = _ADD_REPLY.decode(data)
            if reply.error is not None:
                future.set_exception(reply.error.exception())
            else:
                future.set_result(reply.result)
        elif kind == _STATS:
            future.set_result(_STATS_DECODER.decode(data))
        elif kind in (_STATE, _CONTROL):
            future.set_result(msgspec.msgpack.decode(data))
        else:
            future.set_result(None)

    def _fail(self, error: EngineDeadError) -> None:
        with self._lock:
            first = self._dead is None
            if first:
                self._dead = error
            pending, self._pending = list(self._pending.values()), {}
        for _, future in pending:
            if not future.done():
                future.set_exception(self._dead)
        if first:
            self._on_dead(error)

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()


# ---- the child ------------------------------------------------------------------------------


class _RelayObserver:
    """The executor's ``StartupObserver`` in the child: each call sent to the parent."""

    def __init__(self, send: Callable[[_Message], None], model_id: str = "") -> None:
        self.model_id = model_id
        self._send = send

    def phase(self, rank: int, phase: str) -> None:
        self._send(_Message(_PROGRESS, 0, ["phase", [rank, phase]]))

    def weights(self, rank: int, read_bytes: int, total_bytes: int) -> None:
        self._send(_Message(_PROGRESS, 0, ["weights", [rank, read_bytes, total_bytes]]))


class _Child:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: _Message) -> None:
        data = _ENCODER.encode(message)
        with self.lock:
            self.conn.send_bytes(data)

    def reply(self, call_id: int, ok: bool, data: bytes | None) -> None:
        self.send(_Message(_REPLY, call_id, [ok, data]))

    def reply_future(self, call_id: int, future: concurrent.futures.Future[Any]) -> None:
        def done(f: concurrent.futures.Future[Any]) -> None:
            try:
                self.reply(call_id, True, _ENCODER.encode(f.result()))
            except BaseException as exc:
                self.reply(call_id, False, _ENCODER.encode(CoreError.of(exc)))

        future.add_done_callback(done)

    def run(self) -> None:
        from engine.client.core_loop import EngineCoreLoop
        from engine.config import EngineConfig
        from engine.core.data_parallel import build_engine
        from engine.core.llm_engine import LLMEngine
        from engine.worker.executor import get_executor_class

        start = msgspec.msgpack.decode(_MESSAGE.decode(self.conn.recv_bytes()).data)
        classify = _import(start["classify"]) if start["classify"] else None
        observer = _RelayObserver(self.send)
        try:
            config = EngineConfig.from_kwargs(**start["engine_args"])
            executor_class = get_executor_class(config)

            def build() -> LLMEngine:
                return build_engine(config, lambda c: executor_class(c, observer))

            loop = EngineCoreLoop(build, self._send_step, self._send_dead)
        except BaseException as exc:
            known = classify(exc) if classify is not None else None
            failure = _Failure(known, "".join(traceback.format_exception(exc)))
            self.send(_Message(_FAILED, 0, _ENCODER.encode(failure)))
            return
        executor = loop.engine.executor
        ready = _Ready(executor.startup_summary(), sum(executor.startup_timings.values()))
        self.send(_Message(_READY, 0, _ENCODER.encode(ready)))
        try:
            self._serve(loop)
        finally:
            loop.shutdown()

    def _serve(self, loop: Any) -> None:
        from engine.client.core_messages import AddRequest

        add_decoder = msgspec.msgpack.Decoder(AddRequest)
        while True:
            try:
                message = _MESSAGE.decode(self.conn.recv_bytes())
            except (EOFError, OSError):
                return  # the parent is gone
            kind = message.kind
            if kind == _ADD:
                try:
                    future = loop.add(add_decoder.decode(message.data))
                except msgspec.ValidationError as exc:
                    error = CoreError("invalid", f"malformed request: {exc}")
                    self.reply(message.id, True, _ENCODER.encode(AddReply(error=error)))
                    continue
                self._reply_add(message.id, future)
            elif kind == _ABORT:
                loop.abort(message.data)
            elif kind == _STATS:
                self.reply_future(message.id, loop.stats())
            elif kind == _STATE:
                self.reply_future(message.id, loop.request_state())
            elif kind == _CONTROL:
                name, args = message.data
                self.reply_future(message.id, loop.control(name, tuple(args)))
            elif kind == _HEALTH:
                try:
                    loop.check_health()
                    self.reply(message.id, True, None)
                except BaseException as exc:
                    self.reply(message.id, False, _ENCODER.encode(CoreError.of(exc)))
            elif kind == _STOP:
                return

    def _reply_add(self, call_id: int, future: concurrent.futures.Future[AddResult]) -> None:
        def done(f: concurrent.futures.Future[AddResult]) -> None:
            try:
                reply = AddReply(result=f.result())
            except BaseException as exc:
                reply = AddReply(error=CoreError.of(exc))
            self.reply(call_id, True, _ENCODER.encode(reply))

        future.add_done_callback(done)

    def _send_step(self, step: StepOutputs) -> None:
        self.send(_Message(_STEP, 0, _ENCODER.encode(step)))

    def _send_dead(self, error: EngineDeadError) -> None:
        with contextlib.suppress(OSError):  # the parent is gone already
            self.send(_Message(_DEAD, 0, str(error) or "the engine failed"))


def _import(path: str) -> Callable[[BaseException], str | None]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str]) -> None:
    """The child: ``python -m engine.client.core_process FD`` (the engine package sets up
    logging)."""
    with contextlib.suppress(OSError):  # Linux: ``top`` and ``ps -o comm`` show this name
        Path("/proc/self/comm").write_text("llm-engine-core")
    conn = Connection(int(argv[0]))
    started = time.monotonic()
    try:
        _Child(conn).run()
    finally:
        logger.info("engine core process ends after %.0f s", time.monotonic() - started)
        conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["EngineCoreProcess", "EngineStartFailed", "run_in_child_process"]
