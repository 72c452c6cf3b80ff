"""The ``Executor`` interface: how the head reaches its workers.

Backends are swappable: ``uni`` runs the one worker in the head's process (TP = PP = 1);
distributed backends (Ray, in ``cluster/``) register themselves by name in
``EXECUTOR_BACKENDS`` as an import path, so the engine itself never imports Ray.

A step can be sent before the previous one returns (``execute_model_async`` gives a
``StepFuture``): with pipeline parallelism the engine keeps up to ``max_concurrent_batches``
batches in flight, one per stage, and takes their outputs in the order it sent them.

Start-up is timed per phase (``startup_timings``) and each worker's phase and weight bytes
read go to a ``StartupObserver``, which the cluster layer (``cluster.runtime.load_progress``)
publishes for ``cluster status``; the engine only calls it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.hf_config import num_experts
from engine.worker.step_messages import ExecuteModelRequest, ModelRunnerOutput
from engine.worker.worker import Worker

EXECUTOR_BACKENDS: dict[str, str] = {
    "uni": "engine.worker.executor:UniProcExecutor",
    "ray": "cluster.runtime.ray_executor:RayExecutor",
}


# A worker's start-up phases, in order: what ``cluster status`` shows while a replica starts.
PHASE_STARTING = "starting"  # device, process groups
PHASE_LOADING = "loading weights"
PHASE_KV_SIZING = "sizing KV cache"  # determine_num_available_blocks: the memory profile
PHASE_KV_ALLOCATING = "allocating KV cache / capturing CUDA graphs"  # initialize_cache
PHASE_READY = "ready"


class StartupObserver:
    """Hears an executor's start-up: each worker's phase and, while it loads, the weight bytes
    it has read of its total. This base hears nothing; ``model_id`` names the model for
    whoever shows the progress. Called on the thread that builds the engine (in-process
    workers) or by each worker itself (``cluster.runtime.worker_actor``)."""

    def __init__(self, model_id: str = "") -> None:
        self.model_id = model_id

    def phase(self, rank: int, phase: str) -> None:
        """``rank`` entered ``phase`` (one of the ``PHASE_*``; ``PHASE_READY`` is the last)."""

    def weights(self, rank: int, read_bytes: int, total_bytes: int) -> None:
        """``rank`` has read ``read_bytes`` of the ``total_bytes`` of weights it loads."""


class StepFuture(ABC):
    """One step sent to the workers; ``result`` waits for the sampling worker's output (or
    raises ``EngineDeadError``). Results are taken in the order the steps were sent."""

    @abstractmethod
    def result(self) -> ModelRunnerOutput:
        """The step's output, waiting for it if needed."""


class DoneStep(StepFuture):
    """A step that already ran: its output, or the error it raised (re-raised by ``result``)."""

    def __init__(
        self, output: ModelRunnerOutput | None = None, error: BaseException | None = None
    ) -> None:
        self._output = output
        self._error = error

    def result(self) -> ModelRunnerOutput:
        if self._error is not None:
            raise self._error
        assert self._output is not None  # constructed with one or the other
        return self._output


class Executor(ABC):
    def __init__(self, config: EngineConfig, observer: StartupObserver | None = None) -> None:
        self.config = config
        self.is_dead = False
        self.observer = observer or StartupObserver()
        # Seconds per start-up phase, in the order they ran ("placement", "load", ...).
        self.startup_timings: dict[str, float] = {}

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call ``method`` on every worker; their results in rank order."""

    @abstractmethod
    def execute_model(self, request: ExecuteModelRequest) -> ModelRunnerOutput:
        """Run one step on every worker; the sampling worker's output."""

    def execute_data_parallel(self, requests: list[ExecuteModelRequest]) -> list[ModelRunnerOutput]:
        """One step of every data-parallel engine core at once (``requests[d]``: core d's,
        empty when it has nothing scheduled); each core's output. Only executors of several
        workers have data-parallel ranks."""
        raise NotImplementedError(
            f"data_parallel_size > 1 needs the ray executor backend, not {type(self).__name__}"
        )

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps the engine may have in flight at once (1: each step returns before
        the next is sent; a pipelined executor: its number of pipeline stages)."""
        return 1

    def execute_model_async(self, request: ExecuteModelRequest) -> StepFuture:
        """Send one step; its output comes from the future. Executors that cannot overlap
        steps run it now."""
        try:
            return DoneStep(self.execute_model(request))
        except Exception as exc:  # EngineDeadError and the like, raised at result()
            return DoneStep(error=exc)

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since start, per sparse layer of a mixture-of-experts
        model (``{layer: [tokens per expert]}``, layers ascending): each pipeline stage's TP
        rank 0 counts its own layers' tokens, each data-parallel rank's its own tokens (summed
        here). ``{}`` for a dense model, whose workers are not asked."""
        if not num_experts(self.config.model.hf_config):
            return {}
        merged: dict[int, list[int]] = {}
        for part in self.collective_rpc("expert_load"):
            for layer, counts in part.items():
                total = merged.get(layer, [0] * len(counts))
                merged[layer] = [a + b for a, b in zip(total, counts, strict=True)]
        return dict(sorted(merged.items()))

    def determine_num_available_blocks(self) -> tuple[int, int]:
        with self.startup_phase("KV sizing"):
            self._enter_phase(PHASE_KV_SIZING)
            results = self.collective_rpc("determine_num_available_blocks")
        return min(r[0] for r in results), min(r[1] for r in results)

    def initialize_cache(
        self, num_blocks: int | Sequence[int], num_cpu_blocks: int | Sequence[int]
    ) -> None:
        """Every worker allocates its cache: the blocks (and swap blocks) of each KV cache
        group (an int: every group the same)."""
        with self.startup_phase("cache/graphs"):
            self._enter_phase(PHASE_KV_ALLOCATING)
            self.collective_rpc("initialize_cache", (num_blocks, num_cpu_blocks))
        self._enter_phase(PHASE_READY)

    @contextlib.contextmanager
    def startup_phase(self, name: str) -> Iterator[None]:
        """Add the time the block takes to ``startup_timings[name]``."""
        started = time.monotonic()
        try:
            yield
        finally:
            elapsed = time.monotonic() - started
            self.startup_timings[name] = self.startup_timings.get(name, 0.0) + elapsed

    def startup_summary(self) -> str:
        """``placement 0.4 s, load 9.1 s, KV sizing 0.2 s, cache/graphs 1.1 s``."""
        return ", ".join(f"{name} {s:.1f} s" for name, s in self.startup_timings.items())

    def _enter_phase(self, phase: str) -> None:  # noqa: B027 (optional hook)
        """Tell the observer that every in-process worker entered ``phase``; the default has
        none (workers in other processes report their own phases)."""

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if a worker is gone."""
        if self.is_dead:
            raise EngineDeadError("the engine's workers are dead")

    def shutdown(self) -> None:  # noqa: B027 (optional hook: in-process workers hold nothing)
        """Release workers; the default has nothing to release."""


class UniProcExecutor(Executor):
    """The worker runs in the head's process: no serialization, no hop."""

    def __init__(self, config: EngineConfig, observer: StartupObserver | None = None) -> None:
        super().__init__(config, observer)
        self.worker = Worker(config)
        with self.startup_phase("load"):
            self._enter_phase(PHASE_STARTING)
            self.worker.init_device()
            self._enter_phase(PHASE_LOADING)
            self.worker.load_model(progress=functools.partial(self.observer.weights, 0))

    def _enter_phase(self, phase: str) -> None:
        self.observer.phase(0, phase)

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, request: ExecuteModelRequest) -> ModelRunnerOutput:
        try:
            output = self.worker.execute_model(request)
        except Exception as exc:
            self.is_dead = True
            raise EngineDeadError(f"worker failed during execute_model: {exc}") from exc
        if output is None:
            raise EngineDeadError("the in-process worker returned no sampler output")
        return output


def get_executor_class(config: EngineConfig) -> type[Executor]:
    backend = config.parallel.executor_backend
    if backend not in EXECUTOR_BACKENDS:
        raise ValueError(
            f"distributed_executor_backend: {backend!r} is not available "
            f"(available: {', '.join(sorted(EXECUTOR_BACKENDS))})"
        )
    module_name, _, class_name = EXECUTOR_BACKENDS[backend].partition(":")
    return getattr(importlib.import_module(module_name), class_name)
