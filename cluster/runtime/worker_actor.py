"""``WorkerActor``: one engine ``Worker`` (one GPU, or one CPU bundle) inside a Ray actor.

The class is plain Python; ``RayExecutor`` wraps it with ``ray.remote`` and the resources of
its bundle. Start-up calls (config, rendezvous, loading) travel through Ray's own transport;
the per-step message is the msgspec-encoded ``ExecuteModelRequest`` and the reply the
msgspec-encoded ``ModelRunnerOutput``, so no project object is pickled on the hot path. Steps
arrive through a Ray Compiled Graph's loop (``cluster.runtime.step_dispatch``) or as plain actor
calls; with the graph, control calls (``call``, ``ping``) run on the actor's own thread beside that
loop, so they must only read step state (the engine sends them between steps).

Each actor publishes its own start-up progress (``cluster.runtime.load_progress``: phase, weight
bytes read of its total) from construction until ``initialize_cache`` returns; the executor deletes
what a killed actor leaves behind.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from cluster.runtime.load_progress import LoadProgressPublisher
from engine.config import EngineConfig
from engine.worker.executor import (
    PHASE_KV_ALLOCATING,
    PHASE_KV_SIZING,
    PHASE_LOADING,
    PHASE_STARTING,
)
from engine.worker.step_messages import decode_request, encode
from engine.worker.worker import Worker

logger = logging.getLogger("llm_cluster.worker_actor")

# The start-up calls (through ``call``) and the phase each one is.
_STARTUP_PHASES = {
    "load_model": PHASE_LOADING,
    "determine_num_available_blocks": PHASE_KV_SIZING,
    "initialize_cache": PHASE_KV_ALLOCATING,
}


class WorkerActor:
    """Rank ``rank`` of the TP x PP world. Lifecycle, driven by the executor:
    ``init_device`` -> (rank 0) ``start_rendezvous`` -> ``init_distributed`` -> ``load_model``
    -> ``determine_num_available_blocks`` -> ``initialize_cache`` -> ``execute_model`` per step.
    """

    def __init__(
        self, config: EngineConfig, rank: int, model_id: str = "", executor_id: str = ""
    ) -> None:
        self.rank = rank
        parallel = dataclasses.replace(config.parallel, rank=rank)
        # Data parallelism: steps come as a DataParallelStep, of which this rank runs its core's.
        self.dp_rank = parallel.dp_rank if parallel.data_parallel_size > 1 else None
        self.worker = Worker(dataclasses.replace(config, parallel=parallel))
        self.progress = LoadProgressPublisher(
            model_id, executor_id or "local", rank, self.node_ip()
        )
        self.progress.phase(PHASE_STARTING)

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        """The Ray node this rank runs on (its placement bundle's node)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def init_device(self) -> None:
        # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU, so it is always index 0.
        self.worker.init_device(0)
        if self.worker.config.device.device_type == "cpu":
            self._use_reserved_cpus()

    def _use_reserved_cpus(self) -> None:
        """Compute on as many threads as this actor's bundle reserves CPUs. The driver's
        ``OMP_NUM_THREADS`` reaches the actor through its environment and is meant for one
        process; with several CPU workers busy at once (pipelined stages, TP ranks) it would
        oversubscribe the cores, and OpenMP threads that wait by spinning make that several
        times slower, not just even."""
        import ray
        import torch

        reserved = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
        threads = max(1, int(reserved))
        if torch.get_num_threads() != threads:
            logger.info(
                "rank %d: %d compute thread(s), one per reserved CPU (was %d)",
                self.rank,
                threads,
                torch.get_num_threads(),
            )
            torch.set_num_threads(threads)

    def num_threads(self) -> int:
        """The compute threads this rank's torch uses."""
        import torch

        return torch.get_num_threads()

    def start_rendezvous(self, timeout_s: float) -> tuple[str, int]:
        """Host the rendezvous store on this node's address; (address, OS-assigned port)."""
        host = self.node_ip()
        return host, self.worker.start_rendezvous(host, timeout_s)

    def execute_model(self, request: bytes) -> bytes | None:
        """One step; also what the executor's compiled graph binds
        (``cluster.runtime.step_dispatch``), whose errors do not say which actor raised: the
        message names the rank."""
        try:
            output = self.worker.execute_model(decode_request(request, self.dp_rank))
        except Exception as exc:
            raise WorkerStepError(f"rank {self.rank}: {type(exc).__name__}: {exc}") from exc
        return encode(output) if output is not None else None

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``collective_rpc`` target: a public method of the wrapped ``Worker``. A start-up
        call publishes its phase first (``load_model`` its bytes read as it goes too);
        ``initialize_cache``, the last one, ends the publishing."""
        if method.startswith("_") or not callable(getattr(self.worker, method, None)):
            raise AttributeError(f"method: Worker has no public method {method!r}")
        phase = _STARTUP_PHASES.get(method)
        if phase is not None:
            self.progress.phase(phase)
        if method == "load_model":
            kwargs = {**kwargs, "progress": self.progress.weights}
        result = getattr(self.worker, method)(*args, **kwargs)
        if method == "initialize_cache":
            self.progress.close()  # ready: the record goes
        return result

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.progress.close()
        self.worker.shutdown()


class WorkerStepError(RuntimeError):
    """A step failed in this worker; the message starts with its rank."""
