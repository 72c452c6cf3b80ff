"""The soak driver's bookkeeping against scripted HTTP responses (no server): every way a
stream can end gets the outcome and the anomalies the soak test relies on, so a soak that
reports no anomaly has really looked for them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from cluster.bench.soak import (
    ReadinessSampler,
    RequestRecord,
    RssSampler,
    SoakLoad,
    SoakSettings,
    findings,
    make_client,
    stream_request,
)
from cluster.bench.soak.load import _http
from cluster.bench.soak.probes import _malloc_trim, health_url, held_rss

http = _http()


def chunk(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    body = {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]}
    return f"data: {json.dumps(body)}\n\n".encode()


DONE = b"data: [DONE]\n\n"
ERROR = b'data: {"error": {"message": "the engine failed", "type": "APIError", "code": null}}\n\n'


def server(parts: list[bytes], status: int = 200, headers: dict[str, str] | None = None,
           raise_after: bool = False, hang: bool = False) -> Any:  # fmt: skip
    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part
        if raise_after:
            raise http.ReadError("connection reset by peer")
        if hang:
            await asyncio.sleep(3600)

    async def handle(request: Any) -> Any:
        return http.Response(status, headers={"content-type": "text/event-stream",
                                              **(headers or {})}, content=body())  # fmt: skip

    return http.MockTransport(handle)


def run(transport: Any, cancel_after: int | None = None) -> RequestRecord:
    async def go() -> RequestRecord:
        records: dict[int, RequestRecord] = {}
        client = make_client("http://soak.test/v1", None, records, SoakSettings(), transport)
        record = records[0] = RequestRecord(0, "client", "completions", 8, cancel_after, 0.0)
        await stream_request(client, "m", record, {"prompt": "x", "max_tokens": 8, "stream": True})
        await client.close()
        return record

    return asyncio.run(go())


def test_finish_reason_then_done_is_one_success() -> None:
    record = run(server([chunk("a"), chunk("b", "length"), DONE]))
    assert (record.outcome, record.anomalies(), record.chunks) == ("success", [], 2)
    assert record.finishes == ["length"] and record.done_markers == 1


def test_done_split_across_reads_is_counted_once() -> None:
    record = run(server([chunk("a", "stop") + DONE[:9], DONE[9:]]))
    assert (record.outcome, record.anomalies(), record.done_markers) == ("success", [], 1)


def test_success_without_done_is_an_anomaly() -> None:
    record = run(server([chunk("a"), chunk("b", "length")]))
    assert record.anomalies() == ["success_without_done"]


def test_stream_without_finish_reason_or_error_has_no_terminal_event() -> None:
    record = run(server([chunk("a"), DONE]))
    assert (record.outcome, record.anomalies()) == ("none", ["no_terminal_event"])


def test_error_chunk_is_one_error_outcome() -> None:
    record = run(server([chunk("a"), ERROR, DONE]))
    assert (record.outcome, record.anomalies()) == ("error", [])


def test_two_finish_reasons_are_several_terminal_events() -> None:
    record = run(server([chunk("a", "length"), chunk("", "stop"), DONE]))
    assert (record.outcome, record.anomalies()) == ("several", ["several_terminal_events"])


def test_data_after_done_is_an_anomaly() -> None:
    record = run(server([chunk("a", "length"), DONE, chunk("b")]))
    assert record.anomalies() == ["data_after_done"]


def test_connection_broken_mid_stream_is_an_anomaly() -> None:
    record = run(server([chunk("a")], raise_after=True))
    assert (record.outcome, record.anomalies()) == ("none", ["broken_stream"])


def test_client_closing_mid_stream_is_one_abort() -> None:
    record = run(server([chunk("a"), chunk("b"), chunk("c", "length"), DONE]), cancel_after=2)
    assert (record.outcome, record.anomalies(), record.chunks) == ("abort", [], 2)


def test_503_overloaded_is_refused_and_never_accepted() -> None:
    error = {
        "message": "busy",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": "overloaded",
    }
    body = json.dumps({"error": error}).encode()
    record = run(server([body], 503, {"content-type": "application/json", "retry-after": "1"}))
    assert (record.accepted, record.outcome, record.retry_after_s) == (False, "refused", 1.0)
    assert record.anomalies() == []


def test_other_http_error_is_rejected() -> None:
    body = b'{"error": {"message": "bad", "type": "BadRequestError", "param": "x", "code": null}}'
    record = run(server([body], 400, {"content-type": "application/json"}))
    assert (record.accepted, record.outcome) == (False, "rejected")


def test_request_past_its_client_timeout_is_a_hang() -> None:
    async def go() -> RequestRecord:
        records: dict[int, RequestRecord] = {}
        settings = SoakSettings(request_timeout_s=0.5, cancel_fraction=0.0, chat_fraction=0.0)
        transport = server([chunk("a")], hang=True)
        client = make_client("http://soak.test/v1", None, records, settings, transport)
        load = SoakLoad(client, "m", settings, records)
        record = await load.send_one("client")
        await client.close()
        return record

    record = asyncio.run(go())
    assert record.timed_out and record.anomalies() == ["hang"]


def test_settings_out_of_range_raise_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"^warmup_s: must be in \[0, duration_s\)"):
        SoakSettings(duration_s=10, warmup_s=10).check()
    with pytest.raises(ValueError, match=r"^max_tokens: must be \(lo, hi\)"):
        SoakSettings(max_tokens=(8, 4)).check()


def test_bursts_start_inside_the_warmup_then_follow_the_interval() -> None:
    settings = SoakSettings(duration_s=54, warmup_s=18, burst_interval_s=9)
    assert settings.burst_times() == [9, 18, 27, 36, 45]


def test_cli_without_a_target_exits_2_asking_for_one() -> None:
    result = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "soak"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert "give --config (deploy locally) or --base-url" in result.stderr


def test_memory_growth_compares_the_readings_at_rest_after_each_half() -> None:
    """Samples under load (bursts held longer in one half) give the trend and the peak; the
    growth is between the two readings at rest, each after a full collection."""
    mb = 2**20
    reads = iter([100 * mb, 104 * mb])
    collected: list[bool] = []

    async def reader(collect: bool) -> int:
        collected.append(collect)
        return next(reads)

    sampler = RssSampler({"me": reader}, interval_s=1.0)
    sampler.samples["me"] = [(t, (130 if t % 10 < 7 else 100) * mb) for t in range(20)]
    asyncio.run(sampler.read_at_rest("first_half"))
    asyncio.run(sampler.read_at_rest("second_half"))
    entry = sampler.summary()["me"]
    assert (entry["first_half_at_rest_mb"], entry["second_half_at_rest_mb"]) == (100.0, 104.0)
    assert entry["growth_pct"] == 4.0 and entry["peak_mb"] == 130.0 and not entry["gone"]
    assert collected == [True, True]


def test_the_load_rests_with_nothing_in_flight_after_each_half() -> None:
    """Both halves send requests; each rest comes once every request of its half has ended,
    and the second half's bursts wait for the rest to end (their times count from its start)."""
    settings = SoakSettings(
        duration_s=2.0, warmup_s=1.0, clients=3, burst_size=4, burst_interval_s=0.5,
        cancel_fraction=0.0, chat_fraction=0.0,
    )  # fmt: skip
    rests: list[tuple[str, int, int, float]] = []  # label, in flight, requests sent, at (s)

    async def slow_stream(request: Any) -> Any:
        async def body() -> AsyncIterator[bytes]:
            await asyncio.sleep(0.05)
            for part in (chunk("a"), chunk("b", "length"), DONE):
                yield part

        return http.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    async def go() -> tuple[SoakLoad, dict[int, RequestRecord]]:
        records: dict[int, RequestRecord] = {}
        client = make_client("http://soak.test/v1", None, records, settings,
                             http.MockTransport(slow_stream))  # fmt: skip
        load = SoakLoad(client, "m", settings, records)

        async def rest(label: str) -> None:
            rests.append((label, load.in_flight, len(records), time.monotonic() - load.start))
            await asyncio.sleep(0.3)

        await load.run(rest)
        await client.close()
        return load, records

    load, records = asyncio.run(go())
    assert [(label, in_flight) for label, in_flight, _, _ in rests] == [
        ("first_half", 0), ("second_half", 0)
    ]  # fmt: skip
    first_half = [r for r in records.values() if r.id < rests[0][2]]
    second_half = [r for r in records.values() if r.id >= rests[0][2]]
    assert first_half and second_half
    assert all(r.end <= rests[0][3] for r in first_half)
    assert all(r.start >= rests[0][3] + 0.3 for r in second_half)
    assert [b["at_s"] for b in sorted(load.burst_log, key=lambda b: b["at_s"])] == [0.5, 1.0, 1.5]
    assert sum(r.source == "burst" for r in second_half) == 4 and rests[1][2] == len(records)


@pytest.mark.skipif(_malloc_trim() is None, reason="the C library has no malloc_trim (not glibc)")
def test_held_memory_leaves_out_what_the_allocator_freed_but_kept() -> None:
    """Freed blocks below a live one stay resident under glibc until trimmed: plain RSS counts
    them, ``held_rss`` does not (its figure is what a leak would keep)."""
    import psutil

    process = psutil.Process()
    blocks = [bytearray(4096) for _ in range(40_000)]  # ~160 MB of malloc'd blocks
    for block in blocks:
        block[::512] = b"x" * len(block[::512])  # touched: resident
    kept = blocks[-1]  # the top of the heap stays in use, so free() cannot shrink it
    before = process.memory_info().rss
    del blocks
    plain = process.memory_info().rss
    held = held_rss()
    assert kept and plain > before - 20 * 2**20, (before, plain)  # freed, still resident
    assert held < plain - 100 * 2**20, (plain, held)  # given back


@contextlib.contextmanager
def health_server(answers: Iterator[int | str], paths: list[str]) -> Iterator[str]:
    """A local HTTP server answering each GET with the next of ``answers`` (200 once they run
    out; ``"hang"``: 200 after a second), recording the paths asked; yields an app's base URL."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            paths.append(self.path)
            answer = next(answers, 200)
            if answer == "hang":
                time.sleep(1.0)
                answer = 200
            self.send_response(int(answer))
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/app/v1"
    finally:
        server.shutdown()


def sample_readiness(sampler: ReadinessSampler, until: Callable[[], bool]) -> None:
    """Run ``sampler`` until ``until()`` holds, then stop it and wait for its end."""

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(sampler.run(time.monotonic(), stop))
        while not until():
            await asyncio.sleep(0.02)
        stop.set()
        await task

    asyncio.run(run())


def test_readiness_probes_count_every_answer_but_200_and_the_report_fails_on_them() -> None:
    """``GET /health`` of the base URL's app, every interval: 200s pass, a 503 and a probe
    with no answer in time are findings, each with when it came."""
    paths: list[str] = []
    with health_server(iter([200, 503, 200, "hang"]), paths) as base_url:
        sampler = ReadinessSampler(health_url(base_url), interval_s=0.05, timeout_s=0.5)
        sample_readiness(sampler, lambda: len(sampler.samples) >= 5)
    summary = sampler.summary()
    assert set(paths) == {"/app/health"}
    assert [status for _, status, _ in sampler.samples[:4]] == [200, 503, 200, "ReadTimeout"]
    assert summary["not_ready"] == 2 and summary["probes"] >= 5
    assert [status for _, status in summary["not_ready_at"]] == [503, "ReadTimeout"]
    report = {"requests": {"rejected": 0}, "anomalies": {"count": 0}, "readiness": summary}
    assert findings(report) == [
        f"GET /health was not 200 in 2 of {summary['probes']} probes under load (at s, "
        f"answer): {summary['not_ready_at']}"
    ]


def test_readiness_probes_go_out_on_their_period_while_the_answers_are_slow() -> None:
    """A probe every interval whether or not the last has answered, as a kubelet sends them:
    with every answer taking a second and probes 0.1 s apart, ~1.2 s of sampling sends about
    twelve, each counted once it answers (one after another, it sent two)."""
    paths: list[str] = []
    with health_server(iter(["hang"] * 100), paths) as base_url:
        sampler = ReadinessSampler(health_url(base_url), interval_s=0.1, timeout_s=5.0)
        began = time.monotonic()
        sample_readiness(sampler, lambda: time.monotonic() - began > 1.2)
    assert len(sampler.samples) >= 8, sampler.samples
    assert all(status == 200 and took >= 0.9 for _, status, took in sampler.samples)
    sent = [at for at, _, _ in sampler.samples]
    assert sent == sorted(sent) and max(b - a for a, b in itertools.pairwise(sent)) < 0.5, sent


def test_findings_name_a_rest_not_idle_and_memory_without_readings_at_rest() -> None:
    report = {
        "requests": {"rejected": 0},
        "anomalies": {"count": 0},
        "rss": {"ingress": {"gone": False, "samples": 3}},  # no reading at rest
        "idle_between_halves": {"reached": False, "after": "first_half"},
        "idle": {"reached": True, "after": "second_half"},
    }
    assert findings(report) == [
        "ingress: no memory reading at rest after each half to compare",
        "the replicas were not idle between the halves: {'reached': False, 'after': 'first_half'}",
    ]
    report["rss"]["ingress"]["growth_pct"] = 5.0
    assert findings(report)[0] == "ingress: held memory at rest grew 5.0 % between the halves"
