"""The ``Executor`` interface: how the head reaches its workers.

Backends are swappable: ``uni`` runs the one worker in the head's process (TP = PP = 1);
distributed backends (Ray, in ``cluster/``) register themselves by name in
``EXECUTOR_BACKENDS`` as an import path, so the engine itself never imports Ray.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.protocol import ExecuteModelRequest, ModelRunnerOutput
from engine.worker import Worker

EXECUTOR_BACKENDS: dict[str, str] = {
    "uni": "engine.executor:UniProcExecutor",
    "ray": "cluster.ray_executor:RayExecutor",
}


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.is_dead = False

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call ``method`` on every worker; their results in rank order."""

    @abstractmethod
    def execute_model(self, request: ExecuteModelRequest) -> ModelRunnerOutput:
        """Run one step on every worker; the sampling worker's output."""

    def determine_num_available_blocks(self) -> tuple[int, int]:
        results = self.collective_rpc("determine_num_available_blocks")
        return min(r[0] for r in results), min(r[1] for r in results)

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks, num_cpu_blocks))

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if a worker is gone."""
        if self.is_dead:
            raise EngineDeadError("the engine's workers are dead")

    def shutdown(self) -> None:  # noqa: B027 (optional hook: in-process workers hold nothing)
        """Release workers; the default has nothing to release."""


class UniProcExecutor(Executor):
    """The worker runs in the head's process: no serialization, no hop."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()

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
