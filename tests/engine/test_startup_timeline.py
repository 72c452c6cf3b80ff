"""A start-up timeline reads as durations and parses back to the same marks."""

from __future__ import annotations

import logging
import time

import pytest

from engine.startup_timeline import StartupTimeline, parse_timelines, process_start_time


def test_durations_run_from_each_mark_to_the_next() -> None:
    timeline = StartupTimeline("head m")
    timeline.marks = [("created", 100.0), ("config", 100.5), ("weights read", 103.0)]
    assert timeline.durations() == [("config", 0.5), ("weights read", 2.5)]
    assert timeline.line().startswith(
        "start-up timeline of head m: config 0.50 s, weights read 2.50 s | epochs "
    )


def test_the_line_parses_back_to_its_marks() -> None:
    timeline = StartupTimeline("worker rank 0")
    timeline.marks = [("created", 1764940001.125), ("KV allocation", 1764940003.5)]
    text = f"INFO 2026-12-05 llm_cluster.worker: {timeline.line()}\nanother line\n"
    assert parse_timelines(text) == [("worker rank 0", timeline.marks)]


def test_the_process_start_is_the_first_mark_and_before_now() -> None:
    started = process_start_time()
    assert started is not None and time.time() - 3600 < started <= time.time()
    timeline = StartupTimeline("cluster serve", from_process_start=True)
    assert timeline.marks == [("process start", pytest.approx(started))]


def test_logged_once_and_no_marks_after(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.startup")
    timeline = StartupTimeline("worker rank 0")
    timeline.mark("created")
    timeline.mark("KV allocation")
    with caplog.at_level(logging.INFO, logger="test.startup"):
        timeline.log(logger)
        timeline.mark("KV allocation")  # a wake from sleep: no start
        timeline.log(logger)
    assert len(caplog.records) == 1
    assert len(timeline.marks) == 2
