"""``cluster bench soak``: a soak test, bounded in time, against an OpenAI-compatible endpoint.

    clients  --clients streaming clients loop until --duration: completions (random token-id
             prompts) and chat (random words), random max_tokens; about --cancel-fraction of the
             requests are closed by the client at a random point of their stream
    bursts   every --burst-interval s, one-shot streams sent at once, enough to bring the burst
             requests in flight up to --burst-size (by default 10x the model's
             max_ongoing_requests: well above capacity, so admission control must answer 503
             rather than queue without bound); the first falls inside the warm-up
    memory   the resident set of each model replica, the ingress and Serve's HTTP proxy,
             sampled every --rss-interval s; the --warmup s (allocator pools filling, the first
             burst) are left out and the rest of --duration (not the tail in which the last
             requests finish) split into two halves by time: growth is the median of the
             second half over the median of the first
    idle     after the run every replica of the model is polled until idle: free KV blocks
             must equal the total and no per-request state may remain on the head or workers

Every request ends in exactly one outcome:

    success   HTTP 200, one finish_reason (stop / length), then [DONE]
    error     HTTP 200, then an error chunk
    abort     HTTP 200, then the client closed the stream before it finished
    refused   HTTP 503 "overloaded" before the stream (admission control): never accepted
    rejected  any other failure before the stream: never accepted, and a finding, since the
              soak sends only valid requests

An accepted request is one that got its 200 (the server had taken it: the ingress answers only
after the model server validated and enqueued it). Anything else is an anomaly: a stream that
ends without a finish_reason or error chunk, or a success without [DONE]; a second terminal
event (two finish_reasons, a finish then an error, data after [DONE]); a connection broken
mid-stream; a request that outlives its client timeout (a hang). Streams are read with the
official ``openai`` client; a tap on its HTTP transport counts the [DONE] markers that the
client itself consumes silently.

``python -m cluster.bench.soak --config configs/tiny.yaml --duration 600`` deploys the config
on a new local Ray, runs the soak, prints the report as JSON and exits 1 on any finding;
``--base-url`` drives a running endpoint instead (outcomes only, unless ``--address`` attaches
to its Ray cluster for the memory and idle checks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TAP_HEADER = "x-soak-request"
OUTCOMES = ("success", "error", "abort", "refused", "rejected")
WORDS = [
    "the", "cache", "block", "of", "a", "paged", "request", "streams", "tokens", "while",
    "scheduler", "batches", "prefill", "and", "decode", "steps", "under", "budget", "so", "that",
    "every", "replica", "serves", "many", "clients", "at", "once", "without", "leak", "memory",
]  # fmt: skip


@dataclass(frozen=True)
class SoakSettings:
    duration_s: float = 600.0
    warmup_s: float = 60.0
    clients: int = 48
    cancel_fraction: float = 0.1
    burst_size: int = 320
    burst_interval_s: float = 60.0
    prompt_len: tuple[int, int] = (8, 160)  # token ids (completions) or words (chat)
    max_tokens: tuple[int, int] = (4, 128)
    chat_fraction: float = 0.5
    request_timeout_s: float = 120.0
    rss_interval_s: float = 1.0
    vocab_size: int = 1000  # completion prompts draw token ids below it
    seed: int = 0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of its range."""
        rules = [
            ("duration_s", self.duration_s > 0, "must be > 0"),
            ("warmup_s", 0 <= self.warmup_s < self.duration_s, "must be in [0, duration_s)"),
            ("clients", self.clients >= 1, "must be >= 1"),
            ("cancel_fraction", 0 <= self.cancel_fraction <= 1, "must be in [0, 1]"),
            ("burst_size", self.burst_size >= 0, "must be >= 0"),
            ("burst_interval_s", self.burst_interval_s > 0, "must be > 0"),
            ("chat_fraction", 0 <= self.chat_fraction <= 1, "must be in [0, 1]"),
            ("request_timeout_s", self.request_timeout_s > 0, "must be > 0"),
            ("rss_interval_s", self.rss_interval_s > 0, "must be > 0"),
            ("vocab_size", self.vocab_size > 5, "must be > 5"),
        ]
        for name, ok, message in rules:
            if not ok:
                raise ValueError(f"{name}: {message}, got {getattr(self, name)!r}")
        for name in ("prompt_len", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name}: must be (lo, hi) with 0 < lo <= hi, got {(lo, hi)}")

    def burst_times(self) -> list[float]:
        """Seconds from the start: one burst in the middle of the warm-up (so its allocations
        are part of the baseline), then one every ``burst_interval_s`` after it."""
        if self.burst_size == 0:
            return []
        times, at = [], self.warmup_s / 2
        while at < self.duration_s:
            times.append(at)
            at += self.burst_interval_s
        return times


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    id: int
    source: str  # "client" (a looping client) or "burst"
    endpoint: str  # "completions" or "chat"
    max_tokens: int
    cancel_after: int | None  # close the stream after this many chunks; None: read to the end
    start: float
    end: float = 0.0
    status: int | None = None  # HTTP status; None if no response headers came
    error_code: str | None = None
    retry_after_s: float | None = None
    chunks: int = 0  # chunks carrying a choice (usage chunks excluded)
    completion_tokens: int = 0  # from the usage chunk, or the chunks read before an abort
    finishes: list[str] = field(default_factory=list)  # every finish_reason seen
    error_chunks: int = 0
    done_markers: int = 0  # counted by the transport tap
    data_after_done: int = 0
    closed_by_client: bool = False
    broken: str | None = None  # the exception that broke the connection, if one did
    timed_out: bool = False
    server_request_id: str | None = None  # the x-request-id header: finds it in Serve's logs
    last_chunk_at: float | None = None  # seconds from the start of the soak

    @property
    def accepted(self) -> bool:
        return self.status == 200

    def terminal_events(self) -> list[str]:
        events = ["success"] * len(self.finishes) + ["error"] * self.error_chunks
        return events + (["abort"] if self.closed_by_client else [])

    @property
    def outcome(self) -> str:
        """One of ``OUTCOMES``, or "none" / "several" for an accepted request without exactly
        one terminal event (an anomaly)."""
        if not self.accepted:
            return "refused" if self.error_code == "overloaded" else "rejected"
        events = self.terminal_events()
        if len(events) != 1:
            return "none" if not events else "several"
        return events[0]

    def anomalies(self) -> list[str]:
        found = []
        if self.timed_out:
            found.append("hang")
        if self.broken is not None:
            found.append("broken_stream")
        if not self.accepted:
            return found
        events = self.terminal_events()
        if not events and not found:
            found.append("no_terminal_event")
        if len(events) > 1:
            found.append("several_terminal_events")
        if events == ["success"] and self.done_markers == 0:
            found.append("success_without_done")
        if self.done_markers > 1 or self.data_after_done:
            found.append("data_after_done")
        return found


# ---- the client side -------------------------------------------------------------------------


def _http() -> Any:
    """The HTTP library the installed ``openai`` client is built on."""
    try:
        import httpx2

        return httpx2
    except ImportError:
        import httpx

        return httpx


def _done_tap(inner: Any, records: dict[int, RequestRecord]) -> Any:
    """An HTTP transport that counts, per tagged request, the ``data: [DONE]`` lines of the
    response and the data lines after them. The ``openai`` client stops reading at [DONE], so
    once the tap sees it, it reads the response to its end itself: a correct server has
    nothing more to send, and one that keeps the stream open is caught as a hang."""
    http = _http()

    class TappedStream(http.AsyncByteStream):
        def __init__(self, stream: Any, record: RequestRecord) -> None:
            self.stream, self.record, self.pending = stream, record, b""

        async def __aiter__(self) -> AsyncIterator[bytes]:
            parts = aiter(self.stream)
            async for part in parts:
                self._scan(part)
                if self.record.done_markers:
                    async for rest in parts:
                        self._scan(rest)
                        part += rest
                yield part

        def _scan(self, part: bytes) -> None:
            lines = (self.pending + part).split(b"\n")
            self.pending = lines.pop()
            for line in lines:
                line = line.rstrip(b"\r")
                if line == b"data: [DONE]":
                    self.record.done_markers += 1
                elif line.startswith(b"data:") and self.record.done_markers:
                    self.record.data_after_done += 1

        async def aclose(self) -> None:
            await self.stream.aclose()

    class DoneTap(http.AsyncBaseTransport):
        async def handle_async_request(self, request: Any) -> Any:
            response = await inner.handle_async_request(request)
            record = records.get(int(request.headers.get(TAP_HEADER, -1)))
            if record is None:
                return response
            return http.Response(
                status_code=response.status_code,
                headers=response.headers,
                stream=TappedStream(response.stream, record),
                extensions=response.extensions,
                request=request,
            )

        async def aclose(self) -> None:
            await inner.aclose()

    return DoneTap()


def make_client(
    base_url: str,
    api_key: str | None,
    records: dict[int, RequestRecord],
    settings: SoakSettings,
    transport: Any = None,
) -> Any:
    """An ``AsyncOpenAI`` client with no retries (a 503 is an outcome to count), no cap on its
    connections (a burst reaches the server at once instead of queueing in the client, and
    bursts overlap while their accepted requests stream), and the [DONE] tap on its transport
    (``transport``, by default a plain HTTP one)."""
    import openai

    http = _http()
    limits = http.Limits(max_connections=None, max_keepalive_connections=settings.clients + 16)
    transport = _done_tap(transport or http.AsyncHTTPTransport(limits=limits), records)
    # The client's own timeout is a backstop: the soak's per-request timeout fires first.
    http_client = openai.DefaultAsyncHttpxClient(
        transport=transport, limits=limits, timeout=settings.request_timeout_s + 30
    )
    return openai.AsyncOpenAI(
        base_url=base_url, api_key=api_key or "not-needed", max_retries=0, http_client=http_client
    )


def _request_body(rng: random.Random, endpoint: str, settings: SoakSettings) -> dict[str, Any]:
    length = rng.randint(*settings.prompt_len)
    # Mostly ignore_eos, so most streams run to max_tokens and a cancellation lands mid-stream;
    # the rest may stop early on EOS (finish_reason "stop").
    body: dict[str, Any] = {
        "max_tokens": rng.randint(*settings.max_tokens),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": rng.random() < 0.8},
    }
    if endpoint == "chat":
        words = " ".join(rng.choice(WORDS) for _ in range(length))
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = [rng.randrange(5, settings.vocab_size) for _ in range(length)]
    return body


async def stream_request(
    client: Any, model: str, record: RequestRecord, body: dict[str, Any], start: float = 0.0
) -> None:
    """Send one streaming request and record what came back (never raises for the server's
    behaviour: every failure is recorded on ``record``); times are relative to ``start``
    (monotonic)."""
    import openai

    create = (
        client.chat.completions.create if record.endpoint == "chat" else client.completions.create
    )
    try:
        stream = await create(model=model, extra_headers={TAP_HEADER: str(record.id)}, **body)
    except openai.APIConnectionError as exc:
        record.broken = f"{type(exc).__name__}: {exc}"
        return
    except openai.APIStatusError as exc:
        record.status = exc.status_code
        error = exc.body if isinstance(exc.body, dict) else {}
        record.error_code = (error.get("error") or error).get("code")
        retry_after = exc.response.headers.get("retry-after")
        record.retry_after_s = float(retry_after) if retry_after else None
        return
    record.status = 200
    record.server_request_id = stream.response.headers.get("x-request-id")
    try:
        await _read_stream(stream, record, start)
    finally:
        await stream.close()


async def _read_stream(stream: Any, record: RequestRecord, start: float) -> None:
    import openai

    try:
        if record.cancel_after == 0:
            record.closed_by_client = True
            return
        async for chunk in stream:
            if chunk.usage is not None:
                record.completion_tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            record.chunks += 1
            record.last_chunk_at = time.monotonic() - start
            if chunk.choices[0].finish_reason is not None:
                record.finishes.append(chunk.choices[0].finish_reason)
            cancel = record.cancel_after
            if cancel is not None and not record.finishes and record.chunks >= cancel:
                record.closed_by_client = True
                record.completion_tokens = record.chunks
                return
    except openai.APIConnectionError as exc:
        record.broken = f"{type(exc).__name__}: {exc}"
    except openai.APIError:  # the client raises on an error chunk
        record.error_chunks += 1


class SoakLoad:
    """The load of one soak run: looping clients, bursts, and every request's record."""

    def __init__(
        self, client: Any, model: str, settings: SoakSettings, records: dict[int, RequestRecord]
    ) -> None:
        self.client, self.model, self.settings = client, model, settings
        self.records = records
        self.rng = random.Random(settings.seed)
        self.start = 0.0
        self.in_flight = 0
        self.burst_in_flight = 0
        self.peak_in_flight = 0
        self.burst_log: list[dict[str, Any]] = []

    async def run(self) -> None:
        self.start = time.monotonic()
        deadline = self.start + self.settings.duration_s
        clients = [
            asyncio.create_task(self._client_loop(deadline)) for _ in range(self.settings.clients)
        ]
        bursts = [asyncio.create_task(self._burst(at)) for at in self.settings.burst_times()]
        await asyncio.gather(*clients, *bursts)

    def _new_record(self, source: str) -> tuple[RequestRecord, dict[str, Any]]:
        rng, settings = self.rng, self.settings
        endpoint = "chat" if rng.random() < settings.chat_fraction else "completions"
        body = _request_body(rng, endpoint, settings)
        cancel_after = None
        if rng.random() < settings.cancel_fraction:
            cancel_after = rng.randint(0, max(0, body["max_tokens"] - 2))
        record = RequestRecord(
            len(self.records),
            source,
            endpoint,
            body["max_tokens"],
            cancel_after,
            time.monotonic() - self.start,
        )
        self.records[record.id] = record
        return record, body

    async def send_one(self, source: str) -> RequestRecord:
        """One random request, streamed to its end, its cancel point or its timeout."""
        record, body = self._new_record(source)
        self.in_flight += 1
        self.burst_in_flight += source == "burst"
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await asyncio.wait_for(
                stream_request(self.client, self.model, record, body, self.start),
                self.settings.request_timeout_s,
            )
        except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11
            record.timed_out = True
        finally:
            self.in_flight -= 1
            self.burst_in_flight -= source == "burst"
            record.end = time.monotonic() - self.start
        return record

    async def _client_loop(self, deadline: float) -> None:
        rng = random.Random(self.rng.random())
        await asyncio.sleep(rng.uniform(0, 1))  # the clients do not all start in one instant
        while time.monotonic() < deadline:
            record = await self.send_one("client")
            if record.outcome == "refused":
                # Honour Retry-After, with jitter so refused clients do not return in lockstep.
                await asyncio.sleep((record.retry_after_s or 1.0) * rng.uniform(0.5, 1.5))
            elif not record.accepted:
                await asyncio.sleep(1.0)
            else:
                await asyncio.sleep(rng.uniform(0, 0.2))

    async def _burst(self, at: float) -> None:
        """Top the burst requests in flight up to ``burst_size`` at once. Accepted ones outlive
        the interval (they queue behind the seats), so a full burst on top of them would raise
        the peak concurrency from burst to burst, and with it the servers' memory high-water
        mark; topped up, every burst reaches the same peak, the first one in the warm-up."""
        await asyncio.sleep(max(0.0, self.start + at - time.monotonic()))
        size = max(0, self.settings.burst_size - self.burst_in_flight)
        results = await asyncio.gather(*(self.send_one("burst") for _ in range(size)))
        outcomes = Counter(r.outcome for r in results)
        self.burst_log.append(
            {"at_s": round(at, 1), "sent": size, **dict(sorted(outcomes.items()))}
        )


# ---- the server side: processes and replica state ---------------------------------------------


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
        from cluster.serve import deployment_name

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

        app = serve.status().applications[self.app_name]
        states = app.deployments[self.deployment].replica_states
        return sum(n for s, n in states.items() if getattr(s, "value", s) == "RUNNING")

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


# ---- one run ---------------------------------------------------------------------------------


async def soak(
    base_url: str,
    model: str,
    settings: SoakSettings,
    *,
    api_key: str | None = None,
    probe: ServeProbe | None = None,
    idle_timeout_s: float = 60.0,
    progress: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """Run the load for ``settings.duration_s`` (plus the in-flight requests' tails) and return
    the report (``findings(report)`` lists what failed). With a ``probe``, resident memory is
    sampled during the run and every replica must go idle after it."""
    settings.check()
    records: dict[int, RequestRecord] = {}
    client = make_client(base_url, api_key, records, settings)
    load = SoakLoad(client, model, settings, records)
    sampler = None
    if probe is not None:
        sampler = RssSampler(await asyncio.to_thread(probe.pids), settings.rss_interval_s)
    stop = asyncio.Event()
    load.start = time.monotonic()
    sampling = asyncio.create_task(sampler.run(load.start, stop)) if sampler else None
    ticker = asyncio.create_task(_report_progress(load, settings, progress))
    try:
        await load.run()
    finally:
        stop.set()
        ticker.cancel()
        if sampling is not None:
            await sampling
        await client.close()
    load_s = time.monotonic() - load.start
    report = summarize(list(records.values()), load, settings, load_s)
    if probe is not None and sampler is not None:
        report["rss"] = sampler.summary(settings.warmup_s, settings.duration_s)
        try:
            idle, states, waited = await asyncio.to_thread(probe.wait_idle, idle_timeout_s)
        except Exception as exc:  # no replica to answer: the finding is that it is gone
            report["idle"] = {"reached": False, "error": f"{type(exc).__name__}: {exc}"}
        else:
            report["idle"] = {"reached": idle, "waited_s": round(waited, 1), "replicas": states}
    return report


async def _report_progress(
    load: SoakLoad, settings: SoakSettings, progress: Callable[[str], None]
) -> None:
    while True:
        await asyncio.sleep(max(5.0, settings.duration_s / 20))
        outcomes = Counter(r.outcome for r in load.records.values() if r.end)
        elapsed = time.monotonic() - load.start
        progress(
            f"{elapsed:6.0f} s  in flight {load.in_flight:4d}  {dict(sorted(outcomes.items()))}"
        )


def summarize(
    records: list[RequestRecord], load: SoakLoad, settings: SoakSettings, load_s: float
) -> dict[str, Any]:
    outcomes = Counter(r.outcome for r in records)
    anomalies = Counter(a for r in records for a in r.anomalies())
    examples = [{"anomalies": r.anomalies(), **asdict(r)} for r in records if r.anomalies()][:10]
    aborts = [r for r in records if r.outcome == "abort"]
    success = [r for r in records if r.outcome == "success"]
    tokens = sum(r.completion_tokens for r in records if r.outcome in ("success", "abort"))
    return {
        "duration_s": round(load_s, 1),
        "requests": {
            "total": len(records),
            "accepted": sum(r.accepted for r in records),
            **{name: outcomes.get(name, 0) for name in OUTCOMES},
        },
        "finish_reasons": dict(Counter(f for r in success for f in r.finishes)),
        "aborts": {
            "before_first_chunk": sum(r.chunks == 0 for r in aborts),
            "mid_stream": sum(r.chunks > 0 for r in aborts),
        },
        "anomalies": {
            "count": sum(anomalies.values()),
            "by_kind": dict(anomalies),
            "examples": examples,
        },
        "bursts": {
            "size": settings.burst_size,
            "runs": sorted(load.burst_log, key=lambda b: b["at_s"]),
        },
        "peak_in_flight": load.peak_in_flight,
        "completion_tokens": tokens,
        "completion_tokens_per_s": round(tokens / load_s, 1),
        "success_latency_s": _percentiles([r.end - r.start for r in success]),
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": round(ordered[-1], 3)}


def findings(report: dict[str, Any], max_rss_growth_pct: float = 5.0) -> list[str]:
    """What the report shows to be wrong; empty when the soak passed."""
    found = []
    requests, anomalies = report["requests"], report["anomalies"]
    if anomalies["count"]:
        found.append(f"{anomalies['count']} anomalies: {anomalies['by_kind']}")
    if requests["rejected"]:
        found.append(f"{requests['rejected']} requests rejected other than by admission control")
    for name, entry in report.get("rss", {}).items():
        if entry["gone"]:
            found.append(f"process {name} went away during the run")
        elif "growth_pct" not in entry:
            found.append(f"{name}: too few memory samples to compare the halves")
        elif entry["growth_pct"] >= max_rss_growth_pct:
            found.append(f"{name}: resident memory grew {entry['growth_pct']} % between halves")
    idle = report.get("idle")
    if idle is not None and not idle["reached"]:
        found.append(f"the replicas were not idle after the run: {idle}")
    return found


# ---- command line ----------------------------------------------------------------------------


def _range(text: str) -> tuple[int, int]:
    from cluster.bench.throughput import _range as parse

    return parse(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--config", type=Path, default=None, help="deploy this YAML on a new local Ray and soak it"
    )
    target.add_argument(
        "--base-url", default=None, help="soak a running endpoint, e.g. http://127.0.0.1:8000/v1"
    )
    parser.add_argument(
        "--address",
        default=None,
        help="with --base-url: its Ray cluster, for the memory and idle checks",
    )
    parser.add_argument("--app", default=None, help="Serve application (default: the config's)")
    parser.add_argument("--model", default=None, help="model name (default: the first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--free-ports",
        action="store_true",
        help="with --config: OS-chosen HTTP and gRPC ports, not the config's",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="with --config: override the model's Serve max_queued_requests",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="with --config: override the engine's max_waiting_requests",
    )
    defaults = SoakSettings()
    parser.add_argument("--duration", type=float, default=defaults.duration_s)
    parser.add_argument("--warmup", type=float, default=defaults.warmup_s)
    parser.add_argument("--clients", type=int, default=defaults.clients)
    parser.add_argument("--cancel-fraction", type=float, default=defaults.cancel_fraction)
    parser.add_argument(
        "--burst-size",
        type=int,
        default=None,
        help="default: 10x the model's max_ongoing_requests (with --config), "
        f"else {defaults.burst_size}",
    )
    parser.add_argument("--burst-interval", type=float, default=defaults.burst_interval_s)
    parser.add_argument("--prompt-len", type=_range, default=defaults.prompt_len, metavar="LO:HI")
    parser.add_argument("--max-tokens", type=_range, default=defaults.max_tokens, metavar="LO:HI")
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s)
    parser.add_argument("--rss-interval", type=float, default=defaults.rss_interval_s)
    parser.add_argument("--max-rss-growth-pct", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak the arguments describe, print the report as JSON; ``SystemExit(1)`` on a
    finding."""
    report = asyncio.run(_run(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    if report["findings"]:
        print("FINDINGS:\n  " + "\n  ".join(report["findings"]), file=sys.stderr)
        raise SystemExit(1)
    return report


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.base_url:
        return await _run_remote(args, progress)
    from cluster.config import load_config
    from cluster.deploy import connect, deploy, endpoint

    config = load_config(_config_dict(args))
    model = config.model(args.model) if args.model else config.models[0]
    settings = _settings(args, 10 * model.deployment_config.max_ongoing_requests)
    connect("local")  # its own Ray: never a stale or foreign cluster found on this machine
    import ray
    from ray import serve

    try:
        await asyncio.to_thread(deploy, config, progress)
        probe = ServeProbe(config.app_name, model.model_id)
        report = await soak(
            endpoint(config),
            model.model_id,
            settings,
            api_key=args.api_key,
            probe=probe,
            progress=progress,
        )
    finally:
        serve.shutdown()
        ray.shutdown()
    return _with_conditions(report, args, settings, str(args.config))


async def _run_remote(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "not-needed")
    model = args.model or (await client.models.list()).data[0].id
    await client.close()
    probe = None
    if args.address:
        from cluster.deploy import connect

        connect(args.address)
        probe = ServeProbe(args.app or "llm", model)
    settings = _settings(args, SoakSettings().burst_size)
    report = await soak(
        args.base_url, model, settings, api_key=args.api_key, probe=probe, progress=progress
    )
    return _with_conditions(report, args, settings, args.base_url)


def _config_dict(args: argparse.Namespace) -> dict[str, Any]:
    """The YAML with this run's overrides: ports, the model's admission-control limits."""
    import yaml

    data = copy.deepcopy(yaml.safe_load(args.config.read_text()))
    if args.free_ports:
        data.setdefault("http_options", {})["port"] = _free_port()
        if data.get("grpc_options") is not None:
            data["grpc_options"]["port"] = _free_port()
    models = data.get("models") or []
    ids = [m.get("model_loading_config", {}).get("model_id") for m in models]
    if args.model is not None and args.model not in ids:
        raise SystemExit(f"--model: {args.model!r} is not in {args.config} (models: {ids})")
    for model in models:
        if args.model not in (None, model["model_loading_config"]["model_id"]):
            continue
        if args.max_queued_requests is not None:
            model.setdefault("deployment_config", {})["max_queued_requests"] = (
                args.max_queued_requests
            )
        if args.max_waiting_requests is not None:
            model.setdefault("engine_kwargs", {})["max_waiting_requests"] = (
                args.max_waiting_requests
            )
        if args.model is None:
            break  # the soak drives the first model
    return data


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _settings(args: argparse.Namespace, default_burst: int) -> SoakSettings:
    settings = SoakSettings(
        duration_s=args.duration,
        warmup_s=args.warmup,
        clients=args.clients,
        cancel_fraction=args.cancel_fraction,
        burst_size=args.burst_size if args.burst_size is not None else default_burst,
        burst_interval_s=args.burst_interval,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        rss_interval_s=args.rss_interval,
        seed=args.seed,
    )
    try:
        settings.check()
    except ValueError as exc:
        raise SystemExit(f"soak: {exc}") from None
    return settings


def _with_conditions(
    report: dict[str, Any], args: argparse.Namespace, settings: SoakSettings, target: str
) -> dict[str, Any]:
    conditions = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}",
        "target": target,
        "max_queued_requests": args.max_queued_requests,
        "max_waiting_requests": args.max_waiting_requests,
        **asdict(settings),
    }
    report = {"conditions": conditions, **report}
    report["findings"] = findings(report, args.max_rss_growth_pct)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    run(require_target(parser, parser.parse_args(argv)))
    return 0


def require_target(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.config is None and args.base_url is None:
        parser.error("give --config (deploy locally) or --base-url (a running endpoint)")
    return args


if __name__ == "__main__":
    sys.exit(main())
