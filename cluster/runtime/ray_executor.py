"""``RayExecutor``: the engine's ``Executor`` over TP x PP ``WorkerActor``s, one per bundle.

Ray does placement, lifecycle, failure detection and the control calls (``collective_rpc``,
``ping``: ordinary actor calls). The per-step hot path carries the msgspec-encoded step message
(encoded once) to every worker and, from the sampling worker only, the encoded reply: a Ray
Compiled Graph on GPU workers, one actor call per worker on CPU workers, picked by device
(``cluster.runtime.step_dispatch``). On GPU the pipeline stages exchange hidden states over
torch.distributed (NCCL) themselves. With ``LLM_CLUSTER_PP_PIPELINING`` and PP > 1, up to
PP steps are in flight at once (``execute_model_async`` returns a ``StepFuture``).

    head (LLMEngine) ──ExecuteModelRequest bytes──▶ rank 0 … rank TP·PP−1
                     ◀──ModelRunnerOutput bytes──── last stage, TP rank 0 (others: None)

Start-up calls wait up to ``LLM_CLUSTER_LOAD_TIMEOUT_S`` each, steps and control calls
``LLM_CLUSTER_STEP_TIMEOUT_S``; a worker that dies, raises or times out makes the executor dead
(``EngineDeadError`` naming the rank, every later call raises). Every TP group is placed on
one node (one bundle per pipeline stage; arithmetic in ``cluster.runtime.placement``), and a
local Ray the engine started may be restarted with more CPUs (``cluster.runtime.local_ray``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.runtime.load_progress import remove_executor_records
from cluster.runtime.local_ray import (
    LOCAL_RAY,
    node_capacities,
    node_names,
    resolve_device,
    worker_runtime_env,
)
from cluster.runtime.placement import (
    PlacementError,
    _describe_nodes,
    assign_ranks_by_node,
    check_nodes_can_host,
    worker_actor_resources,
    worker_slots,
)
from cluster.runtime.step_dispatch import PendingStep, StepDispatch, build_dispatch
from cluster.runtime.worker_actor import WorkerActor
from engine import envs
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.worker.executor import (
    PHASE_KV_ALLOCATING,
    PHASE_KV_SIZING,
    PHASE_LOADING,
    PHASE_READY,
    PHASE_STARTING,
    Executor,
    StartupObserver,
    StepFuture,
)
from engine.worker.step_messages import (
    DataParallelStep,
    ExecuteModelRequest,
    ModelRunnerOutput,
    decode_output,
    encode,
)

logger = logging.getLogger("llm_cluster.ray_executor")

WORKER_NAME_PREFIX = "LLMWorker:"
_REMOVE_AGAIN_AFTER_S = 2.0
# Worker calls bounded by the start-up timeout, with the phase each one belongs to.
_STARTUP_CALLS = {
    "init_device": PHASE_STARTING,
    "start_rendezvous": PHASE_STARTING,
    "init_distributed": PHASE_STARTING,
    "load_model": PHASE_LOADING,
    "determine_num_available_blocks": PHASE_KV_SIZING,
    "initialize_cache": PHASE_KV_ALLOCATING,
}


class RayExecutor(Executor):
    """The engine's executor over Ray worker actors.

    Step dispatch: on GPU workers a Ray Compiled Graph (one ``execute`` per step over
    shared-memory channels, no Ray task per worker); on CPU workers one actor call per worker,
    since the graph's readers spin on a core the CPU workers compute on. The graph carries only
    the step message and the replies.

    Failure: a worker that dies (or raises, or outlasts ``LLM_CLUSTER_STEP_TIMEOUT_S``) makes
    the executor dead: the step that saw it raises ``EngineDeadError`` naming the rank, the
    remaining actors are killed (they may be blocked in a collective with the dead one), the
    compiled graph is torn down (after the kill: teardown waits for actors still in a step),
    and every later call raises until a new executor is built.

    Timeouts: start-up calls (placement, ``init_device`` … ``load_model``,
    ``determine_num_available_blocks``, ``initialize_cache``) wait up to
    ``LLM_CLUSTER_LOAD_TIMEOUT_S`` each, steps and control calls ``LLM_CLUSTER_STEP_TIMEOUT_S``:
    eight workers reading a 70B model's shards take minutes, a step seconds. Ranks load at once
    (one actor call each), so start-up takes the slowest rank's time, not the sum. Each worker
    publishes its progress itself (``cluster.runtime.load_progress``).
    """

    def __init__(self, config: EngineConfig, observer: StartupObserver | None = None) -> None:
        with LOCAL_RAY.lock:
            LOCAL_RAY.ensure_fits(config)
            device = resolve_device(config)
            config = dataclasses.replace(
                config, device=dataclasses.replace(config.device, device=device)
            )
            super().__init__(config, observer)
            LOCAL_RAY.executors.add(self)
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.executor_id = uuid.uuid4().hex[:12]
        # The sampling worker: TP rank 0 of the last pipeline stage; one per data-parallel rank.
        self.driver_rank = self.world_size - parallel.tensor_parallel_size
        group = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self.driver_ranks = [
            (d + 1) * group - parallel.tensor_parallel_size
            for d in range(parallel.data_parallel_size)
        ]
        self._resource = "GPU" if device == "cuda" else "CPU"
        self._step_timeout_s = envs.step_timeout_s()
        self._load_timeout_s = envs.load_timeout_s()
        self.model_id = self.observer.model_id or Path(config.model.model_path).name
        self._dist_timeout_s = envs.dist_timeout_s()
        self._lock = threading.Lock()
        self._started = False  # every worker reached PHASE_READY (and removed its record)
        self.workers: list[Any] = []
        self._dispatch: StepDispatch | None = None  # built when the first step is sent
        self._pg: PlacementGroup | None = None
        self._owns_pg = False
        try:
            with self.startup_phase("placement"):
                bundles = self._acquire_placement_group()
                self.workers = self._spawn_workers(bundles)
            self._init_workers()
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up -----------------------------------------------------------------------

    def _acquire_placement_group(self) -> list[int]:
        """The bundle index of each rank 0..world-1, every TP group on one node: in the
        caller's placement group (a Serve replica's) when there is one, else in a new one of
        one ``{resource: TP}`` bundle per pipeline stage.

        A TP group all-reduces every layer, so its ranks must share a node; pipeline stages
        exchange one tensor per step and may sit on different nodes. Ray never splits a bundle
        across nodes, so one bundle per stage holding the whole TP group (the stage's TP workers
        each take one unit of it) means no placement can cut a TP group, the group is still one
        gang-scheduled placement group, and ``placement_group_strategy`` (PACK by default) says
        only whether stages share a node. A Serve replica's placement group is built the same
        way (``cluster.config``).
        """
        tp = self.config.parallel.tensor_parallel_size
        current = get_current_placement_group()
        if current is not None:
            slots = worker_slots(current.bundle_specs, self._resource)
            if len(slots) < self.world_size:
                raise PlacementError(
                    f"placement group: the current placement group has {len(slots)} worker "
                    f"slots (one per {self._resource}, or one for a fraction of one); "
                    f"tensor_parallel_size x "
                    f"pipeline_parallel_size x data_parallel_size needs {self.world_size}"
                )
            self._pg = current
            # Bundle 0 is usually the replica's own and 1 its head's; workers take the last.
            slots = slots[-self.world_size :]
        else:
            self._check_cluster_can_fit()
            self._pg = self._create_placement_group(tp)
            slots = worker_slots(self._pg.bundle_specs, self._resource)
        return self._ranks_by_node(self._pg, slots, tp)

    def _create_placement_group(self, tp: int) -> PlacementGroup:
        # One bundle per stage, not per worker: per-worker bundles checked after placement let
        # PACK put 3 of 4 bundles on a 3-CPU node and refuse a cluster (3 + 2 CPUs) that could
        # host the replica; nor STRICT_PACK groups per stage: separate groups are not
        # gang-scheduled, so one stage can hold a node while the other waits.
        strategy = self.config.parallel.placement_group_strategy
        parallel = self.config.parallel
        stages = parallel.pipeline_parallel_size * parallel.data_parallel_size
        pg = placement_group([{self._resource: float(tp)}] * stages, strategy=strategy)
        self._pg, self._owns_pg = pg, True  # removed by shutdown if it never becomes ready
        ready, _ = ray.wait([pg.ready()], timeout=min(1.0, self._load_timeout_s))
        if not ready:
            # An engine of this process that its user dropped may still hold the CPUs (GPUs)
            # inside a reference cycle: collected, it frees them (``__del__``).
            gc.collect()
            ready, _ = ray.wait([pg.ready()], timeout=max(0.0, self._load_timeout_s - 1.0))
        if not ready:
            raise PlacementError(
                f"placement group: {stages} bundles of {{{self._resource!r}: {tp}}} (one TP "
                f"group per pipeline stage and data-parallel rank, {strategy}) could not be "
                f"placed within "
                f"{self._load_timeout_s:.0f} s (LLM_CLUSTER_LOAD_TIMEOUT_S); nodes: "
                f"{_describe_nodes(node_capacities(self._resource), self._resource)}; free in "
                f"the cluster: {ray.available_resources().get(self._resource, 0):g} "
                f"{self._resource}"
            )
        return pg

    @staticmethod
    def _ranks_by_node(pg: PlacementGroup, slots: list[int], tp: int) -> list[int]:
        """Deal ranks to the placed slots node by node, whatever the bundles (a placement group
        made elsewhere may have one bundle per worker): the nodes' worker slots in order, so
        ranks ``s*TP .. s*TP+TP-1`` (stage ``s``) share a node; a node holding a number of slots
        that is not a multiple of TP fails at once, naming each node's count: nothing runs
        split."""
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        slot_nodes = [bundle_nodes[bundle] for bundle in slots]
        names = node_names()
        order = assign_ranks_by_node(slot_nodes, tp, names)
        stage_nodes = [names.get(slot_nodes[i], slot_nodes[i]) for i in order[::tp]]
        logger.info(
            "TP groups (by pipeline stage or data-parallel rank), on nodes: %s",
            ", ".join(stage_nodes),
        )
        return [slots[i] for i in order]

    def _check_cluster_can_fit(self) -> None:
        """Fail at once, naming the shortfall, when the cluster's nodes can never hold the
        workers: fewer CPUs (GPUs) in all than workers, or fewer whole TP groups on the nodes
        than pipeline stages (naming each node's CPUs or GPUs). Such a placement group would
        wait ``LLM_CLUSTER_LOAD_TIMEOUT_S`` and fail, or forever. Node totals, not
        what is free: what others hold now may be released while the placement waits."""
        total = ray.cluster_resources().get(self._resource, 0)
        if total < self.world_size:
            hint = LOCAL_RAY.hint_if_started_here()
            raise PlacementError(
                f"placement group: tensor_parallel_size x pipeline_parallel_size x "
                f"data_parallel_size = {self.world_size} workers need {self.world_size} "
                f"{self._resource}, but the Ray cluster has {total:g} {self._resource} in total "
                f"({self.world_size - total:g} short); add nodes or lower the parallel sizes{hint}"
            )
        parallel = self.config.parallel
        check_nodes_can_host(
            node_capacities(self._resource),
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            self._resource,
            parallel.placement_group_strategy,
            parallel.data_parallel_size,
        )

    def _spawn_workers(self, bundles: list[int]) -> list[Any]:
        actor_class = ray.remote(WorkerActor)
        if self._pg is None:
            raise RuntimeError("ray executor: workers spawned before their placement group")
        specs = self._pg.bundle_specs
        runtime_env = worker_runtime_env()
        workers = []
        for rank, bundle in enumerate(bundles):
            # One device, or the bundle's fraction of one (a replica sharing its GPU).
            resources = worker_actor_resources(specs[bundle], self._resource)
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=bundle
            )
            # Named, so operators (and fault-injection tests) can find a model's workers with
            # ``ray list actors`` / ``ray.util.list_named_actors``; owned by this process, so
            # they die with it.
            name = f"{WORKER_NAME_PREFIX}{self.model_id}:{self.executor_id}:rank{rank}"
            options: dict[str, Any] = {"scheduling_strategy": strategy, "name": name, **resources}
            if runtime_env:
                options["runtime_env"] = runtime_env
            workers.append(
                actor_class.options(**options).remote(
                    self.config, rank, self.model_id, self.executor_id
                )
            )
        return workers

    def _init_workers(self) -> None:
        """Every rank at once in each call: the load takes the slowest rank's time. No
        collective runs until every rank has loaded (the first is the KV-sizing profile), so a
        rank that loads faster never waits in one (``LLM_CLUSTER_DIST_TIMEOUT_S``) on a slower."""
        with self.startup_phase("workers"):
            self._get([w.init_device.remote() for w in self.workers], "init_device")
            rendezvous = "none (one worker)"
            if self.world_size > 1:
                host, port = self._get(
                    [self.workers[0].start_rendezvous.remote(self._dist_timeout_s)],
                    "start_rendezvous",
                )[0]
                self.collective_rpc("init_distributed", (host, port, self._dist_timeout_s))
                rendezvous = f"{host}:{port}"
        with self.startup_phase("load"):
            self.collective_rpc("load_model")
        logger.info(
            "%d worker actors ready (DP %d x TP %d x PP %d, %s), rendezvous: %s",
            self.world_size,
            self.config.parallel.data_parallel_size,
            self.config.parallel.tensor_parallel_size,
            self.config.parallel.pipeline_parallel_size,
            self._resource,
            rendezvous,
        )

    def _enter_phase(self, phase: str) -> None:
        # The workers publish their own phases; the executor only notes the end of start-up.
        self._started = self._started or phase == PHASE_READY

    # ---- calls --------------------------------------------------------------------------

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        self._raise_if_dead()
        return self._get([w.call.remote(method, args, kwargs or {}) for w in self.workers], method)

    @property
    def max_concurrent_batches(self) -> int:
        pp = self.config.parallel.pipeline_parallel_size
        return pp if pp > 1 and envs.pp_pipelining() else 1

    @property
    def dispatch_mode(self) -> str:
        """``compiled`` or ``tasks``: how steps go (``""`` before the first step)."""
        return self._dispatch.name if self._dispatch is not None else ""

    def execute_model(self, request: ExecuteModelRequest) -> ModelRunnerOutput:
        return self.execute_model_async(request).result()

    def execute_model_async(self, request: ExecuteModelRequest) -> StepFuture:
        self._raise_if_dead()
        data = encode(request)
        with self._lock:
            self._raise_if_dead()  # shut down meanwhile
            dispatch = self._dispatcher(self.max_concurrent_batches + 1)
        return _RayStep(self, dispatch.send(data))

    def _dispatcher(self, max_inflight: int) -> StepDispatch:
        """The step dispatch, built on the first step (under ``_lock``). It calls back into this
        executor through weak references, so it does not keep an executor nobody holds alive."""
        if self._dispatch is None:
            self._dispatch = build_dispatch(
                self._resource,
                self.workers,
                max_inflight,
                self._step_timeout_s,
                _weakly(self._get),
                _weakly(self._die),
            )
        return self._dispatch

    def execute_data_parallel(self, requests: list[ExecuteModelRequest]) -> list[ModelRunnerOutput]:
        """One step of every data-parallel engine core at once (``requests[d]``: core d's, empty
        when it has nothing scheduled); each core's output, from its own sampling worker."""
        self._raise_if_dead()
        data = encode(DataParallelStep(requests=requests))
        with self._lock:
            self._raise_if_dead()
            dispatch = self._dispatcher(2)
        replies = dispatch.send(data).replies()
        group = len(self.workers) // len(self.driver_ranks)
        return [
            self._merge_replies(replies[d * group : (d + 1) * group], driver - d * group)
            for d, driver in enumerate(self.driver_ranks)
        ]

    def _merge_replies(
        self, replies: list[bytes | None], driver: int | None = None
    ) -> ModelRunnerOutput:
        """The sampling worker's output (``driver``: its index in ``replies``, the executor's
        driver rank by default), with the adapter load errors any other rank reported."""
        driver = self.driver_rank if driver is None else driver
        reply = replies[driver]
        if reply is None:
            self._die(f"the sampling worker (rank {driver}) returned no output")
        output = decode_output(reply)
        for rank, other in enumerate(replies):
            if other is not None and rank != driver:
                # A rank that could not load an adapter or stored KV says so (and nothing else).
                theirs = decode_output(other)
                output.lora_load_errors.update(theirs.lora_load_errors)
                failures = output.kv_load_failures
                for rid, loaded in theirs.kv_load_failures.items():
                    failures[rid] = min(loaded, failures.get(rid, loaded))
        return output

    def check_health(self) -> None:
        super().check_health()
        self._get([w.ping.remote() for w in self.workers], "check_health")

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        """Results in rank order. A worker error surfaces as soon as that worker's call ends
        (not after the others), so a dead rank fails the step while its peers still wait on it."""
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        phase = _STARTUP_CALLS.get(what)
        timeout_s = self._step_timeout_s if phase is None else self._load_timeout_s
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(remaining, 0))
            if not ready:
                self._die(self._timeout_message(what, phase, timeout_s, sorted(pending.values())))
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except RayActorError as exc:
                    self._die(f"{what}: worker rank {rank} died", exc)
                except RayError as exc:
                    self._die(f"{what}: worker rank {rank} failed: {exc}", exc)
        return [results[rank] for rank in range(len(refs))]

    @staticmethod
    def _timeout_message(what: str, phase: str | None, timeout_s: float, ranks: list[int]) -> str:
        if phase is None:
            return (
                f"{what}: worker ranks {ranks} did not answer within {timeout_s:.0f} s "
                "(LLM_CLUSTER_STEP_TIMEOUT_S)"
            )
        return (
            f"start-up phase {phase!r} ({what}): worker ranks {ranks} did not finish within "
            f"{timeout_s:.0f} s; raise LLM_CLUSTER_LOAD_TIMEOUT_S if the start-up is only slow "
            "(a large checkpoint on a slow volume)"
        )

    # ---- failure and shutdown -----------------------------------------------------------

    def _raise_if_dead(self) -> None:
        if self.is_dead:
            raise EngineDeadError("the engine's workers are dead; build a new executor to continue")

    def _die(self, message: str, cause: BaseException | None = None) -> None:
        logger.error("engine dead: %s", message)
        self.shutdown()
        raise EngineDeadError(message) from cause

    def __del__(self) -> None:
        # An executor dropped without shutdown (its LLM gone out of scope) frees its workers
        # and placement group, so the process's next engine can be placed.
        if getattr(self, "is_dead", True) or not ray.is_initialized():
            return
        with contextlib.suppress(Exception):
            self.shutdown()

    def shutdown(self) -> None:
        """Kill the worker actors and remove the placement group if this executor created it."""
        with self._lock:
            self.is_dead = True
            workers, self.workers = self.workers, []
            dispatch, self._dispatch = self._dispatch, None
            for worker in workers:
                ray.kill(worker, no_restart=True)
            if dispatch is not None:
                dispatch.close()
            if workers and not self._started:
                self._remove_progress_records(workers)
            if self._owns_pg and self._pg is not None:
                remove_placement_group(self._pg)
            self._pg, self._owns_pg = None, False

    def _remove_progress_records(self, killed: list[Any]) -> None:
        """Workers killed mid-start-up leave their progress records behind. ``ray.kill``
        returns before a process is gone, and a loading worker writes every 0.5 s meanwhile:
        wait (at most ``_REMOVE_AGAIN_AFTER_S``) until calls to the killed workers fail, then
        remove the records. Not from a background thread: one still using Ray after
        ``ray.shutdown()`` can crash the process (ray-project/ray#31145). A record that outlives
        this anyway is dropped by readers once stale."""
        remove_executor_records(self.executor_id)
        gone = [worker.ping.remote() for worker in killed]
        ray.wait(gone, num_returns=len(gone), timeout=_REMOVE_AGAIN_AFTER_S)
        remove_executor_records(self.executor_id)


class _RayStep(StepFuture):
    """A sent step; ``result`` waits for every rank's reply (once: a second call raises)."""

    def __init__(self, executor: RayExecutor, pending: PendingStep) -> None:
        self._executor = executor
        self._pending: PendingStep | None = pending

    def result(self) -> ModelRunnerOutput:
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("StepFuture.result: this step's output was already taken")
        self._executor._raise_if_dead()  # an earlier step's failure killed the workers
        return self._executor._merge_replies(pending.replies())


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, a bound method of an executor, without a strong reference to it."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        if bound is None:
            raise EngineDeadError("the engine's executor was dropped")
        return bound(*args)

    return call
