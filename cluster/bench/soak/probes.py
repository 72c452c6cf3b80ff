"""The soak's probes of the server side. Over HTTP, readiness: ``GET /health`` on a period while
the load runs, as a Kubernetes readiness probe asks it. Through the app's Ray cluster: the
processes that serve it and the memory each holds over the run, and every replica's request
state (idle after the run: no KV block held, no per-request entry left).

Memory is read inside each process (``held_rss``): its resident set once glibc's allocator has
returned its free pages to the OS. Plain RSS also counts freed memory the allocator keeps for
reuse, which grows for minutes under a changing load and is given back by ``malloc_trim``
(BENCHMARKS.md, "Soak"); a leak is memory still held, which trimming cannot return. Growth is
read at rest, with no request in flight, after each half of the run: under load a process also
holds what its requests in flight hold, and how many are in flight when a sample lands decides
its level."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def held_rss(_actor: Any = None, collect: bool = False) -> int:
    """This process's resident memory in bytes after its allocator returned its free pages to
    the OS (``malloc_trim(0)`` where glibc has it); ``collect``: after a full garbage collection
    first (at rest: cycles still to collect are not held). Runs in the process it measures (an
    actor's ``__ray_call__``)."""
    import gc

    import psutil

    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    return psutil.Process().memory_info().rss


# A process's held memory in bytes, read in it; ``collect`` (at rest): after a full collection.
Reader = Callable[[bool], Awaitable[int]]


class ServeProbe:
    """What a driver attached to the app's Ray cluster can see beyond HTTP: the processes that
    serve it (for their resident memory) and every replica's request state.

    Serve routes a handle call to any replica, so every replica is reached by calling until
    each running replica (counted by ``serve.status``) has answered; ``replica_id`` tells them
    apart. The processes are Serve's named actors: ``SERVE_REPLICA::<app>#<deployment>#<id>``
    and the proxies, ``SERVE_PROXY_ACTOR-<node>``."""

    def __init__(self, app_name: str, model_id: str) -> None:
        from cluster.config import deployment_name

        self.app_name = app_name
        self.deployment = deployment_name(model_id)

    def processes(self) -> dict[str, Reader]:
        """Each process's label and a reader of its held memory (``held_rss``, run in it)."""
        import ray

        found: dict[str, Reader] = {}
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
            found[label] = functools.partial(_read_held_rss, actor)
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


async def _read_held_rss(actor: Any, collect: bool = False) -> int:
    return await actor.__ray_call__.remote(held_rss, collect)


class RssSampler:
    """The held memory of named processes: sampled on a fixed period through the run (its
    trend, for the report) and read at rest after each half (its growth). ``readers`` maps each
    name to a coroutine function returning its bytes (``ServeProbe.processes``). A reader that
    times out skips that sample; one that raises means the process is gone."""

    def __init__(self, readers: dict[str, Reader], interval_s: float) -> None:
        self.readers = readers
        self.interval_s = interval_s
        self.samples: dict[str, list[tuple[float, int]]] = {name: [] for name in readers}
        self.at_rest: dict[str, dict[str, int]] = {}  # "first_half" / "second_half": name: bytes
        self.gone: set[str] = set()

    async def run(self, start: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now = time.monotonic() - start
            live = [name for name in self.readers if name not in self.gone]
            for name, rss in (await self._read(live, collect=False)).items():
                self.samples[name].append((now, rss))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    async def read_at_rest(self, label: str) -> None:
        """Every live process's held memory after a full collection, with nothing in flight:
        the level ``summary`` compares between the halves."""
        live = [name for name in self.readers if name not in self.gone]
        self.at_rest[label] = await self._read(live, collect=True)

    async def _read(self, names: list[str], collect: bool) -> dict[str, int]:
        read = await asyncio.gather(
            *(asyncio.wait_for(self.readers[name](collect), 30) for name in names),
            return_exceptions=True,
        )
        found = {}
        for name, rss in zip(names, read):
            if isinstance(rss, asyncio.TimeoutError):
                continue
            if isinstance(rss, BaseException):  # the process died: a finding of its own
                self.gone.add(name)
            else:
                found[name] = rss
        return found

    def summary(self) -> dict[str, Any]:
        """Each process's memory: its sampled trend and peak, its level at rest after each
        half, and the growth between those two levels. Under load a sample also counts what
        the requests in flight at that instant hold (a burst's: tens of MB in the ingress),
        so samples of two halves differ with the load they land in; at rest, both readings
        count no request."""
        first, second = self.at_rest.get("first_half", {}), self.at_rest.get("second_half", {})
        out: dict[str, Any] = {}
        for name, samples in self.samples.items():
            entry: dict[str, Any] = {"samples": len(samples), "gone": name in self.gone}
            # At most ~40 points of the whole run, to see a trend.
            step = max(1, len(samples) // 40)
            entry["series_mb"] = [[round(t, 1), _mb(rss)] for t, rss in samples[::step]]
            if samples:
                entry["peak_mb"] = _mb(max(rss for _, rss in samples))
            if name in first and name in second:
                entry.update(
                    first_half_at_rest_mb=_mb(first[name]),
                    second_half_at_rest_mb=_mb(second[name]),
                    growth_pct=round(100 * (second[name] - first[name]) / first[name], 2),
                )
            out[name] = entry
        return out


def health_url(base_url: str) -> str:
    """``GET /health`` of the app whose OpenAI base URL (``.../v1``) is ``base_url``."""
    root = base_url.rstrip("/")
    return (root[: -len("/v1")] if root.endswith("/v1") else root) + "/health"


class ReadinessSampler:
    """``GET url`` (the app's ``/health``) every ``interval_s`` while the load runs, as a
    readiness probe asks it: each answer's status (or the error's name: no answer within
    ``timeout_s``, a refused connection) and how long it took. Any answer but 200 would take a
    busy endpoint out of its load balancer's service.

    Probes are sent on the period whether or not the last one has answered, as a kubelet sends
    them, so their number follows the run's length, not the endpoint's latency; at the stop,
    the probes still out are waited for (up to ``timeout_s``) and counted. They go out from a
    thread with an event loop of their own, as a kubelet probes from its own process: on the
    load's loop, busy with hundreds of streams, an answer waits there for seconds after it came
    (BENCHMARKS.md, "Soak")."""

    def __init__(self, url: str, interval_s: float = 1.0, timeout_s: float = 10.0) -> None:
        self.url = url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.samples: list[tuple[float, int | str, float]] = []  # (at, status, seconds)

    async def run(self, start: float, stop: asyncio.Event) -> None:
        """Probe from ``start`` (``time.monotonic()``) until ``stop`` is set."""
        loop = asyncio.new_event_loop()
        halt = asyncio.Event()  # set from this loop's thread; waited on in the probes' loop
        probing = asyncio.ensure_future(
            asyncio.to_thread(loop.run_until_complete, self._probe(start, halt))
        )
        try:
            await stop.wait()
        finally:
            loop.call_soon_threadsafe(halt.set)
            try:
                await probing
            finally:
                loop.close()

    async def _probe(self, start: float, stop: asyncio.Event) -> None:
        import httpx

        async def probe(client: httpx.AsyncClient) -> None:
            sent = time.monotonic()
            status: int | str
            try:
                status = (await client.get(self.url)).status_code
            except Exception as exc:  # no answer (httpx's errors, a URL it refuses): not ready
                status = type(exc).__name__
            self.samples.append((sent - start, status, time.monotonic() - sent))

        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            out: set[asyncio.Task[None]] = set()
            next_at = time.monotonic()
            while not stop.is_set():
                task = asyncio.create_task(probe(client))
                out.add(task)
                task.add_done_callback(out.discard)
                next_at += self.interval_s
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))
            if out:
                await asyncio.wait(out)
        self.samples.sort()

    def summary(self) -> dict[str, Any]:
        """The probes, how many were not a 200 (the first ten: when, and what came back), and
        the answers' latency."""
        from cluster.bench.stats import percentiles

        failed = [[round(at, 1), status] for at, status, _ in self.samples if status != 200]
        seconds = [took for _, _, took in self.samples]
        return {
            "probes": len(self.samples),
            "not_ready": len(failed),
            "not_ready_at": failed[:10],
            "latency_s": {
                **percentiles(seconds, (0.5, 0.9, 0.99), 3),
                "max": round(max(seconds), 3),
            }
            if seconds
            else {},
        }


def _mb(value: float) -> float:
    return round(value / 2**20, 1)
