"""Readiness (``cluster.serving.readiness.unready_models``, what ``/health`` answers) for models
whose replicas Serve runs: a replica whose engine is dead is not ready; one too busy to answer the
health call in time (the call waits behind its ``max_ongoing_requests``, or its queue is full) is
ready, since Serve's own health check of a running replica vouches for it. No Ray: the handles
are fakes and Serve's replica states are given."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.serve.exceptions import BackPressureError

from cluster.serving import readiness


class Handle:
    """A model's handle whose ``health`` call answers ``answer()`` (which may raise or hang)."""

    def __init__(self, answer: Any) -> None:
        self.health = self
        self.answer = answer

    def remote(self) -> Any:
        return self.answer()


async def hangs() -> dict[str, Any]:
    await asyncio.sleep(3600)
    return {"healthy": True}


async def queue_full() -> dict[str, Any]:
    raise BackPressureError(num_queued_requests=8, max_queued_requests=8)


async def dead() -> dict[str, Any]:
    return {"healthy": False, "error": "the engine is dead"}


async def healthy() -> dict[str, Any]:
    return {"healthy": True}


def unready(
    monkeypatch: pytest.MonkeyPatch, answers: dict[str, Any], running: bool | None
) -> dict[str, str]:
    states = None if running is None else {m: {"RUNNING": 1} for m in answers}
    monkeypatch.setattr(readiness, "replica_states", lambda models: states)
    monkeypatch.setattr(readiness, "HEALTH_TIMEOUT_S", 0.05)
    servers = {model: Handle(answer) for model, answer in answers.items()}
    return asyncio.run(readiness.unready_models(servers))  # type: ignore[arg-type]


def test_a_running_model_too_busy_to_answer_in_time_is_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = {"busy": hangs, "full": queue_full, "fine": healthy}
    assert unready(monkeypatch, answers, running=True) == {}


def test_a_dead_engine_is_not_ready_even_beside_busy_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"busy": hangs, "broken": dead}
    assert unready(monkeypatch, answers, running=True) == {"broken": "the engine is dead"}


def test_without_serves_status_a_replica_that_does_not_answer_is_not_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert unready(monkeypatch, {"busy": hangs}, running=None) == {"busy": "TimeoutError"}
