"""The Ray the engine's workers run on: the cluster ``RAY_ADDRESS`` or ``ray start`` made, or
a local one the engine starts (and may restart with more CPUs while none of the process's
executors runs on it: ``LocalRay``); the runtime environment that puts a source checkout on
the workers' import path; which device ``auto`` means there; and the alive nodes by name.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group

from engine.config import EngineConfig
from engine.worker.executor import Executor

logger = logging.getLogger("llm_cluster.ray_executor")

_PROJECT_PACKAGES = ("llm_kernels", "parallel", "engine", "cluster")


def node_names() -> dict[str, str]:
    """Node id -> ``node <ip> (<id prefix>)`` for the alive nodes."""
    return {
        node["NodeID"]: f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]})"
        for node in ray.nodes()
        if node.get("Alive")
    }


def node_capacities(resource: str) -> dict[str, float]:
    """``node <ip> (<id prefix>)`` -> total units of ``resource``, for the alive nodes."""
    return {
        f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]})": node["Resources"].get(
            resource, 0.0
        )
        for node in ray.nodes()
        if node.get("Alive")
    }


class LocalRay:
    """The local Ray this module started (by its session name; never one the user started
    or joined) and the process's executors, which say whether it may be restarted.

    A local Ray this module started (no ``RAY_ADDRESS``, no ``ray start`` cluster) belongs to
    the engine: when a later executor in the process needs more CPUs than it has and no
    executor of the process is alive on it, it is shut down and started again with room
    (logical CPUs are only scheduling tokens here). A Ray the user started or joined is never
    restarted."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.session: str | None = None
        self.executors: weakref.WeakSet[Executor] = weakref.WeakSet()

    def ensure_fits(self, config: EngineConfig) -> None:
        """Connect to Ray for ``config``'s workers, restarting a Ray this module started when
        it is too small for them and no executor of the process runs on it."""
        world_size = config.parallel.world_size
        if not ray.is_initialized():
            self._join_or_start(world_size)
        elif self._too_small_and_idle(config):
            cpus = ray.cluster_resources().get("CPU", 0)
            logger.info(
                "restarting the local Ray this process started (%g CPU) for %d workers",
                cpus,
                world_size,
            )
            ray.shutdown()
            self._start(world_size)

    def started_here(self) -> bool:
        return (
            self.session is not None
            and ray.is_initialized()
            and ray.get_runtime_context().get_session_name() == self.session
        )

    def hint_if_started_here(self) -> str:
        if not self.started_here():
            return ""
        return (
            "; this process started that Ray itself and restarts it with room only while no "
            "engine of the process runs on it (shut the others down first)"
        )

    def _too_small_and_idle(self, config: EngineConfig) -> bool:
        if not self.started_here() or get_current_placement_group() is not None:
            return False
        if any(not executor.is_dead for executor in list(self.executors)):
            return False
        resources = ray.cluster_resources()
        device = config.device.device
        if device == "cuda" or (device == "auto" and resources.get("GPU", 0) >= 1):
            return False  # GPUs are real: a restart adds none
        return resources.get("CPU", 0) < config.parallel.world_size

    def _join_or_start(self, world_size: int) -> None:
        """Join the cluster ``RAY_ADDRESS`` or ``ray start`` made, or start a local one: what
        ``ray.init()`` (vLLM's call) joins, never any other Ray found running on the machine
        (``address="auto"``'s legacy fallback, which would join another program's cluster).
        Job-level runtime_env, so that a checkout's packages also reach workers on other
        nodes (per-actor py_modules cannot upload local dirs)."""
        if _address_to_join() is not None:
            ray.init(runtime_env=_job_runtime_env())
        else:  # nothing to join: start one sized for the workers
            self._start(world_size)

    def _start(self, world_size: int) -> None:
        """A local Ray with at least one logical CPU per worker (a laptop with fewer cores
        than TP x PP workers still runs them, oversubscribed)."""
        ray.init(runtime_env=_job_runtime_env(), num_cpus=max(os.cpu_count() or 1, world_size))
        self.session = ray.get_runtime_context().get_session_name()


LOCAL_RAY = LocalRay()


def _address_to_join() -> str | None:
    """The address ``ray.init()`` joins: ``RAY_ADDRESS``, else the cluster the last ``ray
    start`` on this machine made (its address file in the Ray temp directory); None when it
    would start a new one. Ray's own lookup (private, hence the guard: without it, only the
    environment variable counts)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:
        return os.environ.get("RAY_ADDRESS") or None
    return canonicalize_bootstrap_address(None)


def resolve_device(config: EngineConfig) -> str:
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
    root = Path(__file__).resolve().parents[2]
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


def worker_runtime_env() -> dict[str, Any] | None:
    """From a checkout, put it on the workers' import path (the head's nodes share the path;
    other nodes get the packages from the job-level ``py_modules`` or an installed copy)."""
    root = _checkout_root()
    if root is None:
        return None
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path}}
