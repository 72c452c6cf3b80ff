"""``RayExecutor``: the engine's ``Executor`` over TP x PP ``WorkerActor``s, one per bundle.

Ray does placement and lifecycle; the per-step hot path is one actor call per worker carrying
the msgspec-encoded step message (encoded once, shared by every call) and, from the sampling
worker only, the encoded reply.

    head (LLMEngine) ──ExecuteModelRequest bytes──▶ rank 0 … rank TP·PP−1
                     ◀──ModelRunnerOutput bytes──── last stage, TP rank 0 (others: None)

A worker that dies (or raises) makes the executor dead: the step that saw it raises
``EngineDeadError``, the remaining actors are killed (they may be blocked in a collective
with the dead one), and every later call raises until a new executor is built.

Start-up calls (placement, ``init_device`` … ``load_model``, ``determine_num_available_blocks``,
``initialize_cache``) wait up to ``LLM_CLUSTER_LOAD_TIMEOUT_S`` each, steps and control calls
``LLM_CLUSTER_STEP_TIMEOUT_S``: eight workers reading a 70B model's shards take minutes, a step
seconds. Ranks load at once (one actor call each), so start-up takes the slowest rank's time,
not the sum. Each worker publishes its progress itself (``cluster.load_progress``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.load_progress import remove_executor_records
from cluster.worker_actor import WorkerActor
from engine import envs
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.executor import (
    PHASE_KV_ALLOCATING,
    PHASE_KV_SIZING,
    PHASE_LOADING,
    PHASE_READY,
    PHASE_STARTING,
    Executor,
    StartupObserver,
)
from engine.protocol import ExecuteModelRequest, ModelRunnerOutput, decode_output, encode

logger = logging.getLogger("llm_cluster.ray_executor")

# Step messages above this size are put in the object store once and passed by reference;
# smaller ones travel inline with each actor call, which is cheaper than a ray.put.
_INLINE_LIMIT_BYTES = 64 * 1024
WORKER_NAME_PREFIX = "LLMWorker:"
_PROJECT_PACKAGES = ("kernels", "parallel", "engine", "cluster")
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
    def __init__(self, config: EngineConfig, observer: StartupObserver | None = None) -> None:
        if not ray.is_initialized():
            _init_ray(config.parallel.world_size)
        device = _resolve_device(config)
        config = dataclasses.replace(
            config, device=dataclasses.replace(config.device, device=device)
        )
        super().__init__(config, observer)
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.executor_id = uuid.uuid4().hex[:12]
        # The sampling worker: TP rank 0 of the last pipeline stage.
        self.driver_rank = self.world_size - parallel.tensor_parallel_size
        self._resource = "GPU" if device == "cuda" else "CPU"
        self._step_timeout_s = envs.step_timeout_s()
        self._load_timeout_s = envs.load_timeout_s()
        self.model_id = self.observer.model_id or Path(config.model.model_path).name
        self._dist_timeout_s = envs.dist_timeout_s()
        self._lock = threading.Lock()
        self._started = False  # every worker reached PHASE_READY (and removed its record)
        self.workers: list[Any] = []
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
        """Bundle indices for ranks 0..world-1: the caller's placement group (a Serve replica's)
        when there is one, else a new one of TP x PP bundles."""
        current = get_current_placement_group()
        if current is not None:
            usable = [
                i for i, b in enumerate(current.bundle_specs) if b.get(self._resource, 0) >= 1
            ]
            if len(usable) < self.world_size:
                raise RuntimeError(
                    f"placement group: the current placement group has {len(usable)} bundles with "
                    f"{self._resource} >= 1; tensor_parallel_size x pipeline_parallel_size needs "
                    f"{self.world_size}"
                )
            self._pg = current
            # Bundle 0 is usually the replica's own; workers take the last ones.
            return usable[-self.world_size :]
        self._check_cluster_can_fit()
        strategy = self.config.parallel.placement_group_strategy
        self._pg = placement_group([{self._resource: 1}] * self.world_size, strategy=strategy)
        self._owns_pg = True
        ready, _ = ray.wait([self._pg.ready()], timeout=self._load_timeout_s)
        if not ready:
            raise RuntimeError(
                f"placement group: {self.world_size} bundles of {{{self._resource!r}: 1}} "
                f"({strategy}) could not be placed within {self._load_timeout_s:.0f} s "
                f"(LLM_CLUSTER_LOAD_TIMEOUT_S); cluster resources: {ray.cluster_resources()}"
            )
        return list(range(self.world_size))

    def _check_cluster_can_fit(self) -> None:
        """Fail at once, naming the shortfall, when the whole cluster has fewer CPUs (GPUs)
        than the workers' bundles: such a placement group would wait forever."""
        total = ray.cluster_resources().get(self._resource, 0)
        if total < self.world_size:
            raise RuntimeError(
                f"placement group: tensor_parallel_size x pipeline_parallel_size = "
                f"{self.world_size} workers need {self.world_size} {self._resource}, but the Ray "
                f"cluster has {total:g} {self._resource} in total ({self.world_size - total:g} "
                "short); add nodes or lower the parallel sizes"
            )

    def _spawn_workers(self, bundles: list[int]) -> list[Any]:
        actor_class = ray.remote(WorkerActor)
        if self._resource == "GPU":
            resources: dict[str, float] = {"num_gpus": 1, "num_cpus": 0}
        else:
            resources = {"num_cpus": 1}
        runtime_env = _worker_runtime_env()
        workers = []
        for rank, bundle in enumerate(bundles):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=bundle
            )
            # Named, so operators (and fault-injection tests) can find a model's workers with
            # ``ray list actors`` / ``ray.util.list_named_actors``; owned by this process, so
            # they die with it.
            name = f"{WORKER_NAME_PREFIX}{self.executor_id}:rank{rank}"
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
            "%d worker actors ready (TP %d x PP %d, %s), rendezvous: %s",
            self.world_size,
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

    def execute_model(self, request: ExecuteModelRequest) -> ModelRunnerOutput:
        self._raise_if_dead()
        data = encode(request)
        message = ray.put(data) if len(data) > _INLINE_LIMIT_BYTES else data
        outputs = self._get(
            [w.execute_model.remote(message) for w in self.workers], "execute_model"
        )
        reply = outputs[self.driver_rank]
        if reply is None:
            self._die(f"the sampling worker (rank {self.driver_rank}) returned no output")
        output = decode_output(reply)
        for rank, other in enumerate(outputs):
            if other is not None and rank != self.driver_rank:
                # A rank that could not load an adapter says so (and nothing else).
                output.lora_load_errors.update(decode_output(other).lora_load_errors)
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

    def shutdown(self) -> None:
        """Kill the worker actors and remove the placement group if this executor created it."""
        with self._lock:
            self.is_dead = True
            workers, self.workers = self.workers, []
            for worker in workers:
                ray.kill(worker, no_restart=True)
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


def _init_ray(world_size: int) -> None:
    """Join the cluster ``RAY_ADDRESS`` or ``ray start`` made, or start a local one with at
    least one logical CPU per worker (a laptop with fewer cores than TP x PP workers still runs
    them, oversubscribed). Job-level runtime_env, so that a checkout's packages also reach
    workers on other nodes (per-actor py_modules cannot upload local dirs)."""
    runtime_env = _job_runtime_env()
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=runtime_env)
        return
    try:
        ray.init(address="auto", runtime_env=runtime_env)
    except ConnectionError:  # no cluster on this machine: start one sized for the workers
        ray.init(runtime_env=runtime_env, num_cpus=max(os.cpu_count() or 1, world_size))


def _resolve_device(config: EngineConfig) -> str:
    """``auto`` means: GPUs if the workers' bundles (or else the cluster) have them. The head
    may itself run on a CPU-only node, so its own ``torch.cuda`` says nothing."""
    if config.device.device != "auto":
        return config.device.device
    current = get_current_placement_group()
    if current is not None:
        return "cuda" if any(b.get("GPU", 0) >= 1 for b in current.bundle_specs) else "cpu"
    return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


def _checkout_root() -> Path | None:
    """The source checkout the project runs from, or None when it is installed."""
    root = Path(__file__).resolve().parent.parent
    if "site-packages" in root.parts or not (root / "pyproject.toml").is_file():
        return None
    return root


def _job_runtime_env() -> dict[str, Any] | None:
    root = _checkout_root()
    if root is None:
        return None
    return {
        "py_modules": [str(root / name) for name in _PROJECT_PACKAGES],
        "excludes": ["__pycache__", "*.pyc"],
    }


def _worker_runtime_env() -> dict[str, Any] | None:
    """From a checkout, put it on the workers' import path (the head's nodes share the path;
    other nodes get the packages from the job-level ``py_modules`` or an installed copy)."""
    root = _checkout_root()
    if root is None:
        return None
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path}}
