"""The soak's load generator: its settings, the ``openai`` client with the [DONE] tap on its
transport, one streamed request recorded, and the looping clients and bursts of one run."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from cluster.bench.soak.outcomes import RequestRecord

TAP_HEADER = "x-soak-request"
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

    def middle_s(self) -> float:
        """Where the first half ends: halfway between the warm-up's end and the duration."""
        return (self.warmup_s + self.duration_s) / 2

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

    async def run(self, rest: Callable[[str], Awaitable[None]] | None = None) -> None:
        """The whole load. With ``rest``, in two halves: each half's clients stop at its end,
        its requests run to their ends, then ``rest("first_half")`` (``"second_half"``) is
        awaited with nothing in flight; the second half's bursts keep their times counted
        from its start. Without it, one stretch of ``duration_s``."""
        self.start = time.monotonic()
        settings = self.settings
        if rest is None:
            await self._stretch(0.0, settings.duration_s)
            return
        await self._stretch(0.0, settings.middle_s())
        await rest("first_half")
        await self._stretch(settings.middle_s(), settings.duration_s)
        await rest("second_half")

    async def _stretch(self, begin_s: float, end_s: float) -> None:
        """The load from ``begin_s`` to ``end_s`` of the load's own time, starting now."""
        zero = time.monotonic() - begin_s
        clients = [
            asyncio.create_task(self._client_loop(zero + end_s))
            for _ in range(self.settings.clients)
        ]
        bursts = [
            asyncio.create_task(self._burst(zero, at))
            for at in self.settings.burst_times()
            if begin_s <= at < end_s
        ]
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

    async def _burst(self, zero: float, at: float) -> None:
        """Top the burst requests in flight up to ``burst_size`` at once. Accepted ones outlive
        the interval (they queue behind the seats), so a full burst on top of them would raise
        the peak concurrency from burst to burst, and with it the servers' memory high-water
        mark; topped up, every burst reaches the same peak, the first one in the warm-up."""
        await asyncio.sleep(max(0.0, zero + at - time.monotonic()))
        size = max(0, self.settings.burst_size - self.burst_in_flight)
        results = await asyncio.gather(*(self.send_one("burst") for _ in range(size)))
        outcomes = Counter(r.outcome for r in results)
        self.burst_log.append(
            {"at_s": round(at, 1), "sent": size, **dict(sorted(outcomes.items()))}
        )
