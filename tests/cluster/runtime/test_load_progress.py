"""Start-up progress records (``cluster.runtime.load_progress``) against an in-memory store and a
driven clock: what a record holds, how often it is written, when it is dropped, and how
``cluster status`` describes it. No Ray."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from cluster.runtime.load_progress import (
    KEY_PREFIX,
    STALE_AFTER_S,
    LoadProgressPublisher,
    describe,
    read_load_progress,
    record_key,
    remove_executor_records,
)
from cluster.serving.head_actor import PublishingObserver
from engine.worker.executor import PHASE_LOADING, PHASE_READY, PHASE_STARTING


class DictStore:
    """``ProgressStore`` in a dict, counting writes."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.puts = 0

    def put(self, key: str, value: str) -> None:
        self.data[key] = value
        self.puts += 1

    def delete(self, key: str, by_prefix: bool = False) -> None:
        for k in [k for k in self.data if (k.startswith(key) if by_prefix else k == key)]:
            del self.data[k]

    def items(self, prefix: str) -> list[tuple[str, str]]:
        return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _publisher(store: DictStore, clock: Clock, rank: int = 0) -> LoadProgressPublisher:
    return LoadProgressPublisher(
        "tiny", "exec1", rank, "10.0.0.7", store=store, clock=clock, heartbeat_s=None
    )


def _record(store: DictStore, rank: int = 0) -> dict[str, Any]:
    return json.loads(store.data[record_key("exec1", rank)])


def test_a_record_says_model_executor_rank_node_phase_bytes_and_times() -> None:
    store, clock = DictStore(), Clock()
    publisher = _publisher(store, clock, rank=3)
    publisher.phase(PHASE_LOADING)
    clock.now += 2
    publisher.weights(100, 400)
    record = _record(store, rank=3)
    assert record == {
        "model_id": "tiny",
        "executor_id": "exec1",
        "rank": 3,
        "node": "10.0.0.7",
        "phase": PHASE_LOADING,
        "bytes_read": 100,
        "bytes_total": 400,
        "started_at": 1000.0,
        "phase_started_at": 1000.0,
        "updated_at": 1002.0,
    }


def test_bytes_are_written_at_most_twice_a_second_but_phases_and_the_end_at_once() -> None:
    store, clock = DictStore(), Clock()
    publisher = _publisher(store, clock)
    publisher.phase(PHASE_LOADING)
    assert store.puts == 1
    for read in range(1, 100):  # 99 tensors within 0.099 s: none written
        clock.now += 0.001
        publisher.weights(read, 1000)
    assert store.puts == 1
    clock.now += 0.5
    publisher.weights(100, 1000)
    assert store.puts == 2 and _record(store)["bytes_read"] == 100
    publisher.weights(1000, 1000)  # complete: written though only just after the last
    assert store.puts == 3 and _record(store)["bytes_read"] == 1000
    publisher.phase("sizing KV cache")
    assert store.puts == 4 and _record(store)["phase"] == "sizing KV cache"


def test_closing_removes_the_record_and_nothing_is_written_after() -> None:
    store, clock = DictStore(), Clock()
    publisher = _publisher(store, clock)
    publisher.phase(PHASE_LOADING)
    publisher.close()
    assert store.data == {}
    clock.now += 10
    publisher.weights(5, 10)
    publisher.phase(PHASE_LOADING)
    assert store.data == {}


def test_the_heartbeat_keeps_a_quiet_phase_fresh() -> None:
    store = DictStore()
    publisher = LoadProgressPublisher("tiny", "exec1", 0, "n", store=store, heartbeat_s=0.05)
    publisher.phase("allocating KV cache / capturing CUDA graphs")
    first = _record(store)["updated_at"]
    deadline = 100
    while _record(store)["updated_at"] == first and deadline:
        time.sleep(0.02)
        deadline -= 1
    publisher.close()
    assert deadline, "no heartbeat write"
    assert store.data == {}


def test_readers_drop_stale_and_unreadable_records() -> None:
    store, clock = DictStore(), Clock()
    live, dead = _publisher(store, clock, rank=0), _publisher(store, clock, rank=1)
    dead.phase(PHASE_LOADING)  # its worker is then killed: never written again
    clock.now += STALE_AFTER_S + 1
    live.phase(PHASE_LOADING)
    store.data[KEY_PREFIX + "garbage:0"] = "{not json"
    records = read_load_progress(store, now=clock.now)
    assert [r["rank"] for r in records] == [0]


def test_an_executors_records_are_removed_together() -> None:
    store, clock = DictStore(), Clock()
    for rank in range(2):
        _publisher(store, clock, rank).phase(PHASE_LOADING)
    other = LoadProgressPublisher("tiny", "exec2", 0, "n", store=store, heartbeat_s=None)
    other.phase(PHASE_LOADING)
    remove_executor_records("exec1", store)
    assert list(store.data) == [record_key("exec2", 0)]


def test_the_heads_observer_publishes_per_rank_until_ready_or_closed() -> None:
    store = DictStore()
    observer = PublishingObserver("tiny", "exec1", "10.0.0.7", store=store)
    for rank in range(2):
        observer.phase(rank, PHASE_STARTING)
        observer.phase(rank, PHASE_LOADING)
        observer.weights(rank, 10, 10)
    assert _record(store, rank=1)["bytes_read"] == 10
    observer.phase(0, PHASE_READY)
    assert list(store.data) == [record_key("exec1", 1)]
    observer.close()
    assert store.data == {}


def test_describe_gives_gib_percent_and_seconds() -> None:
    record = {
        "model_id": "m",
        "rank": 1,
        "node": "10.0.0.7",
        "phase": PHASE_LOADING,
        "bytes_read": 3 << 30,
        "bytes_total": 12 << 30,
        "started_at": 100.0,
        "phase_started_at": 110.0,
        "updated_at": 150.0,
    }
    entry = describe(record, now=152.0)
    assert entry["read_gib"] == 3.0 and entry["total_gib"] == 12.0
    assert entry["percent"] == 25.0
    assert entry["seconds"] == 52.0 and entry["phase_seconds"] == 42.0
    assert describe({**record, "bytes_total": 0}, now=152.0)["percent"] is None


@pytest.mark.parametrize("phase", [PHASE_STARTING, PHASE_LOADING])
def test_publishing_without_a_store_does_not_fail(phase: str) -> None:
    # No Ray here: the GCS store finds no internal KV and does nothing.
    publisher = LoadProgressPublisher("tiny", "exec1", 0, "n", heartbeat_s=None)
    publisher.phase(phase)
    publisher.weights(1, 2)
    publisher.close()
    assert read_load_progress() == []


def test_cluster_status_prints_a_line_per_starting_worker(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cluster.cli import _print_loading

    base = {"node": "10.0.0.7", "bytes_total": 17 << 30, "started_at": 0.0}
    loading = {**base, "rank": 0, "phase": PHASE_LOADING, "bytes_read": 3 << 30}
    sizing = {**base, "rank": 1, "phase": "sizing KV cache", "bytes_read": 17 << 30}
    _print_loading(
        [
            describe({**loading, "phase_started_at": 5.0}, now=47.0),
            describe({**sizing, "phase_started_at": 40.0}, now=47.0),
        ]
    )
    assert capsys.readouterr().out.splitlines() == [
        "    starting: rank 0 on 10.0.0.7: loading weights 3.00/17.00 GiB (18%), "
        "47 s since start (42 s in phase)",
        "    starting: rank 1 on 10.0.0.7: sizing KV cache, 47 s since start (7 s in phase)",
    ]
    small = {**loading, "bytes_read": 1 << 19, "bytes_total": 1 << 20, "phase_started_at": 0.0}
    _print_loading([describe(small, now=3.0)])
    assert "loading weights 0.50/1.00 MiB (50%)" in capsys.readouterr().out


def test_deploy_progress_gives_each_model_its_time_to_ready(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cluster.cli import _with_time_to_ready

    report = _with_time_to_ready(time.monotonic() - 214)
    lines = [
        "LLMServer:m: UPDATING (1 starting)",
        "LLMServer:m: HEALTHY (1 running)",
        "OpenAIIngress: HEALTHY (1 running)",
        "LLMServer:m: HEALTHY (2 running)",
    ]
    for line in lines:
        report(f"  {line}")
    assert capsys.readouterr().out.splitlines() == [
        "  LLMServer:m: UPDATING (1 starting)",
        "  LLMServer:m: HEALTHY (1 running), ready in 214 s",
        "  OpenAIIngress: HEALTHY (1 running)",
        "  LLMServer:m: HEALTHY (2 running)",
    ]
