"""How ``RayExecutor`` sends each step to its workers and gets their replies: one role, two paths,
picked by the workers' device (``build_dispatch``).

``compiled`` (GPU workers, ``CompiledDispatch``): a Ray Compiled Graph binds every worker's
``WorkerActor.execute_model(bytes) -> bytes | None`` to one input::

    InputNode ──step bytes──▶ rank 0 … rank TP·PP−1 ──replies──▶ MultiOutputNode

``tasks`` (CPU workers, ``TaskDispatch``): one actor call per worker per step (the message put
in the object store once when it is large); also used when compiling fails (logged with the
reason). The compiled graph's readers spin on a core each, which CPU workers compute on
(BENCHMARKS.md, "Pipelined PP").

Either way ``send`` returns a ``PendingStep`` whose ``replies`` waits for every rank (at most
the step timeout) and, on a worker that died, raised or hung, calls ``fail`` (the executor's
``_die``), which raises ``EngineDeadError``. Steps may be sent before earlier ones' replies are
taken (up to ``max_inflight`` at once); replies are taken in the order the steps were sent.
"""

from __future__ import annotations

import logging
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NoReturn

import ray
from ray.exceptions import RayActorError, RayChannelError, RayChannelTimeoutError, RayError

logger = logging.getLogger("llm_cluster.step_dispatch")

# Step messages above this size are put in the object store once and passed by reference
# (tasks path); smaller ones travel inline with each actor call, cheaper than a ray.put.
_INLINE_LIMIT_BYTES = 64 * 1024
_PROBE_TIMEOUT_S = 2.0
# A reply already there is still read when the step's deadline has just passed.
_MIN_GET_TIMEOUT_S = 0.1

Replies = list[bytes | None]
Fail = Callable[[str, BaseException | None], NoReturn]


class PendingStep(ABC):
    """One step sent to every rank."""

    @abstractmethod
    def replies(self) -> Replies:
        """Every rank's reply in rank order; calls ``fail`` (which raises) on a worker failure."""


class StepDispatch(ABC):
    name: str

    @abstractmethod
    def send(self, message: bytes) -> PendingStep:
        """Send the encoded ``ExecuteModelRequest`` to every rank."""

    def close(self) -> None:  # noqa: B027 (optional hook: the tasks path holds nothing)
        """Release what the dispatch holds; the worker actors are already killed or idle."""


class _TaskStep(PendingStep):
    def __init__(self, refs: list[Any], get: Callable[[list[Any], str], list[Any]]) -> None:
        self._refs = refs
        self._get = get

    def replies(self) -> Replies:
        return self._get(self._refs, "execute_model")


class TaskDispatch(StepDispatch):
    """One Ray actor call per worker; ``get`` is the executor's ``_get`` (per-rank errors,
    step timeout, ``_die``)."""

    name = "tasks"

    def __init__(self, workers: list[Any], get: Callable[[list[Any], str], list[Any]]) -> None:
        self._workers = workers
        self._get = get

    def send(self, message: bytes) -> PendingStep:
        arg: Any = ray.put(message) if len(message) > _INLINE_LIMIT_BYTES else message
        return _TaskStep([w.execute_model.remote(arg) for w in self._workers], self._get)


class CompiledDispatch(StepDispatch):
    """The workers' ``execute_model`` in one compiled graph.

    Compiled once, when the first step is sent (the workers are loaded and the KV cache exists
    by then). A step is one ``compiled.execute(message)``: the message is written once into a
    shared-memory channel every worker reads (Ray pushes it to readers on other nodes), each
    worker's reply comes back on its own channel. No Ray task is submitted per worker per step;
    the graph's execution loop runs in each actor beside its ordinary methods, so the control
    calls (``collective_rpc``, ``ping``) still go as plain actor calls. Channels grow to fit a
    larger message (Ray resizes them; a 20 MB message was checked), so no buffer size is
    configured. On GPU the pipeline stages pass hidden states to each other themselves
    (torch.distributed, NCCL); the graph carries only the step message and the replies, never a
    tensor.

    The graph's readers wait by spinning: the head while it waits for replies and every worker
    while it waits for the next step call ``sched_yield`` in a loop (Ray's
    ``PlasmaObjectHeader::ReadAcquire``, seen with py-spy), a core each. GPU nodes have those
    cores to spare; CPU workers compute on them, hence ``tasks`` there.
    """

    name = "compiled"

    def __init__(self, workers: list[Any], max_inflight: int, timeout_s: float, fail: Fail) -> None:
        from ray.dag import InputNode, MultiOutputNode

        self._workers = workers
        self._timeout_s = timeout_s
        self._fail = fail
        self._rank_of_actor = {w._actor_id.hex(): rank for rank, w in enumerate(workers)}
        with InputNode() as message:
            dag = MultiOutputNode([w.execute_model.bind(message) for w in workers])
        self._compiled = dag.experimental_compile(_max_inflight_executions=max_inflight)
        # A process that exits with a compiled graph still up can abort in Ray's C++ code
        # ("Experimental mutable object must be in the local object store"): tear it down at
        # the latest when this object goes or the interpreter exits.
        self._finalizer = weakref.finalize(self, _teardown_quietly, self._compiled)

    def send(self, message: bytes) -> PendingStep:
        try:
            refs = self._compiled.execute(message)
        except RayError as exc:
            self._fail_for(exc, "execute_model: sending the step", list(range(len(self._workers))))
        return _CompiledStep(self, refs)

    def close(self) -> None:
        self._finalizer()

    def collect(self, refs: list[Any]) -> Replies:
        """Every rank's reply, the sampling rank's (the last stage's, the last to finish)
        first. Ray closes the graph's channels as soon as any of its actors dies, so that get
        raises then, whichever rank died; a hung rank ends it at the step timeout."""
        deadline = time.monotonic() + self._timeout_s
        order = list(range(len(refs)))[::-1]
        results: dict[int, bytes | None] = {}
        for rank in order:
            try:
                remaining = max(deadline - time.monotonic(), _MIN_GET_TIMEOUT_S)
                results[rank] = ray.get(refs[rank], timeout=remaining)
            except RayError as exc:
                self._fail_for(exc, "execute_model", [r for r in order if r not in results])
        return [results[rank] for rank in range(len(refs))]

    def _fail_for(self, exc: RayError, what: str, waiting: list[int]) -> NoReturn:
        if isinstance(exc, RayChannelTimeoutError):
            # The graph reads a step's replies together, so all of them are late; a rank that
            # does not answer a ping either is the one stuck (a rank waiting for it in a
            # collective still answers).
            self._fail(
                f"{what}: worker ranks {sorted(waiting)} did not answer within "
                f"{self._timeout_s:.0f} s (LLM_CLUSTER_STEP_TIMEOUT_S); not answering a ping "
                f"either: {self._silent_ranks()}",
                exc,
            )
        if isinstance(exc, RayActorError):
            rank = self._rank_of_actor.get(str(exc.actor_id or ""))
            dead = [rank] if rank is not None else self._dead_ranks()
            self._fail(f"{what}: worker rank(s) {dead or 'unknown'} died", exc)
        if isinstance(exc, RayChannelError):
            self._fail(
                f"{what}: the compiled graph's channels are closed; dead worker rank(s): "
                f"{self._dead_ranks() or 'none found'} ({exc})",
                exc,
            )
        # A worker raised: WorkerActor.execute_model names its rank in the message.
        self._fail(f"{what}: a worker failed: {exc}", exc)

    def _dead_ranks(self) -> list[int]:
        """The ranks whose actor is dead (by a short ping probe)."""
        return [rank for rank, state in enumerate(self._probe()) if state == "dead"]

    def _silent_ranks(self) -> list[int]:
        """The ranks that did not answer a short ping probe, dead or not."""
        return [rank for rank, state in enumerate(self._probe()) if state != "ok"]

    def _probe(self) -> list[str]:
        """``ok``, ``dead`` or ``silent`` per rank, after at most ``_PROBE_TIMEOUT_S``."""
        probes = [w.ping.remote() for w in self._workers]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=_PROBE_TIMEOUT_S)
        answered = set(ready)
        states = []
        for probe in probes:
            if probe not in answered:
                states.append("silent")
                continue
            try:
                ray.get(probe, timeout=0)
                states.append("ok")
            except RayActorError:
                states.append("dead")
            except RayError:
                states.append("silent")
        return states


class _CompiledStep(PendingStep):
    def __init__(self, dispatch: CompiledDispatch, refs: list[Any]) -> None:
        self._dispatch = dispatch
        self._refs = refs

    def replies(self) -> Replies:
        return self._dispatch.collect(self._refs)


def _teardown_quietly(compiled: Any) -> None:
    """Tear a compiled graph down. Its actors may be killed already (the executor kills them
    first, so that teardown never waits on a rank stuck in a step); Ray then logs each
    failed cancel with a traceback, which says nothing here."""
    dag_logger = logging.getLogger("ray.dag.compiled_dag_node")
    level = dag_logger.level
    dag_logger.setLevel(logging.CRITICAL)
    try:
        compiled.teardown()
    except Exception as exc:  # teardown is best effort: the actors are gone either way
        logger.debug("compiled graph teardown: %s", exc)
    finally:
        dag_logger.setLevel(level)


def dispatch_for(resource: str) -> str:
    """``compiled`` for GPU workers, ``tasks`` for CPU workers (``resource``: the Ray resource
    they hold). Not a setting: tests and ``benchmarks/tp_step_roundtrip.py`` replace this
    function to run the compiled graph on CPU workers."""
    return "compiled" if resource == "GPU" else "tasks"


def build_dispatch(
    resource: str,
    workers: list[Any],
    max_inflight: int,
    timeout_s: float,
    get: Callable[[list[Any], str], list[Any]],
    fail: Fail,
) -> StepDispatch:
    """The dispatch for workers holding ``resource`` (``dispatch_for``); ``tasks`` when a
    compiled graph cannot be built here, with the reason logged."""
    if dispatch_for(resource) == "compiled":
        try:
            return CompiledDispatch(workers, max_inflight, timeout_s, fail)
        except Exception as exc:  # any compile failure: the tasks path still serves
            logger.warning(
                "could not compile the step graph for the %s workers (%s: %s); sending steps "
                "as one Ray actor call per worker instead",
                resource,
                type(exc).__name__,
                exc,
            )
    return TaskDispatch(workers, get)
