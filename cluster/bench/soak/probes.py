"""The soak's probes of the server side, through the app's Ray cluster: the processes that
serve it and their resident memory over the run, and every replica's request state (idle
after the run: no KV block held, no per-request entry left)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from typing import Any


def _getpid(_actor: Any) -> int:
    return os.getpid()


class ServeProbe:
    """What a driver attached to the app's Ray cluster can see beyond HTTP: the processes that
    serve it (for their resident memory) and every replica's request state.

    Serve routes a handle call to any replica, so every replica is reached by calling until
    each running replica (counted by ``serve.status``) has answered; ``replica_id`` tells them
    apart. The processes are Serve's named actors: ``SERVE_REPLICA::<app>#<deployment>#<id>``
    and the proxies, ``SERVE_PROXY_ACTOR-<node>``; ``__ray_call__`` asks each for its pid."""

    def __init__(self, app_name: str, model_id: str) -> None:
        from cluster.config import deployment_name

        self.app_name = app_name
        self.deployment = deployment_name(model_id)

    def pids(self) -> dict[str, int]:
        import ray

        found: dict[str, int] = {}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"]
            if entry["namespace"] != "serve":
                continue
            if name.startswith(f"SERVE_REPLICA::{self.app_name}#"):
                _, deployment, replica = name.split("#", 2)
                label = f"{deployment}#{replica}"
            elif name.startswith("SERVE_PROXY_ACTOR"):
                label = "proxy"
            else:
                continue
            actor = ray.get_actor(name, namespace="serve")
            found[label] = ray.get(actor.__ray_call__.remote(_getpid), timeout=60)
        return found

    def num_replicas(self) -> int:
        from ray import serve

        from cluster.serving.scale_to_zero import running_replicas

        app = serve.status().applications[self.app_name]
        return running_replicas(app.deployments[self.deployment].replica_states)

    def each_replica(self, method: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """What handle method ``method`` (``stats`` or ``request_state``) returns on every
        running replica, ordered by replica id."""
        from ray import serve

        handle = serve.get_deployment_handle(self.deployment, self.app_name)
        expected = self.num_replicas()
        seen: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(seen) < expected and time.monotonic() < deadline:
            calls = [getattr(handle, method).remote() for _ in range(2 * expected)]
            for call in calls:
                answer = call.result(timeout_s=timeout_s)
                seen[answer["replica_id"]] = answer
        if len(seen) < expected:
            raise TimeoutError(f"{len(seen)} of {expected} replicas answered in {timeout_s} s")
        return sorted(seen.values(), key=lambda s: s["replica_id"])

    def wait_idle(self, timeout_s: float) -> tuple[bool, list[dict[str, Any]], float]:
        """Poll until every replica is idle; returns (idle, the last states, seconds waited)."""
        start = time.monotonic()
        while True:
            states = self.each_replica("request_state")
            waited = time.monotonic() - start
            idle = bool(states) and all(replica_is_idle(s) for s in states)
            if idle or waited > timeout_s:
                return idle, states, waited
            time.sleep(0.5)


def replica_is_idle(state: dict[str, Any]) -> bool:
    """Every KV block free, no per-request entry in any head table or on any worker."""
    return (
        state["kv_free_blocks"] == state["kv_total_blocks"]
        and not any(state["head"].values())
        and not any(state["workers"])
    )


class RssSampler:
    """Resident set size of named processes, sampled on a fixed period."""

    def __init__(self, pids: dict[str, int], interval_s: float) -> None:
        import psutil

        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.interval_s = interval_s
        self.samples: dict[str, list[tuple[float, int]]] = {name: [] for name in pids}
        self.gone: set[str] = set()

    async def run(self, start: float, stop: asyncio.Event) -> None:
        import psutil

        while not stop.is_set():
            now = time.monotonic() - start
            for name, process in self.processes.items():
                try:
                    self.samples[name].append((now, process.memory_info().rss))
                except psutil.Error:  # the process died: a finding of its own
                    self.gone.add(name)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    def summary(self, warmup_s: float, end_s: float) -> dict[str, Any]:
        """Each process's memory growth: the ``warmup_s`` (allocator pools filling, the first
        burst) are left out and the rest up to ``end_s`` (the run's duration, not the tail in
        which the last requests finish) split into two halves by time; growth is the median of
        the second half over the median of the first."""
        middle = (warmup_s + end_s) / 2
        out: dict[str, Any] = {}
        for name, samples in self.samples.items():
            first = [rss for t, rss in samples if warmup_s <= t < middle]
            second = [rss for t, rss in samples if middle <= t <= end_s]
            entry: dict[str, Any] = {"samples": len(samples), "gone": name in self.gone}
            # At most ~40 points of the whole run (warm-up included), to see a trend.
            step = max(1, len(samples) // 40)
            entry["series_mb"] = [[round(t, 1), _mb(rss)] for t, rss in samples[::step]]
            if first and second:
                m1, m2 = statistics.median(first), statistics.median(second)
                entry.update(
                    warmup_end_mb=_mb(max((r for t, r in samples if t < warmup_s), default=0)),
                    first_half_median_mb=_mb(m1),
                    second_half_median_mb=_mb(m2),
                    first_half_max_mb=_mb(max(first)),
                    second_half_max_mb=_mb(max(second)),
                    growth_pct=round(100 * (m2 - m1) / m1, 2),
                )
            out[name] = entry
        return out


def _mb(value: float) -> float:
    return round(value / 2**20, 1)
