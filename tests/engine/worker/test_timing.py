"""The step timer syncs the device only when asked to (a profiling switch), never by default."""

from __future__ import annotations

import pytest
import torch

from engine.timing import StepTimer, device_synchronizer


class CountingSync:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def run_step(timer: StepTimer) -> None:
    timer.start()
    for phase in ("prepare_inputs", "forward", "lm_head", "sample"):
        timer.lap(phase)


def test_laps_do_not_sync_the_device_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_CLUSTER_STEP_PROFILE", raising=False)
    sync = CountingSync()
    timer = StepTimer(sync=sync)
    run_step(timer)
    assert sync.calls == 0
    assert set(timer.totals) == {"prepare_inputs", "forward", "lm_head", "sample"}


def test_profiling_switch_syncs_at_every_phase_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_CLUSTER_STEP_PROFILE", "1")
    sync = CountingSync()
    timer = StepTimer(sync=sync)
    run_step(timer)
    assert timer.syncs_device
    assert sync.calls == 5  # start + 4 laps


def test_device_sync_can_be_turned_on_for_a_measurement() -> None:
    sync = CountingSync()
    timer = StepTimer(sync=sync, device_sync=False)
    run_step(timer)
    timer.device_sync = True
    timer.reset()
    run_step(timer)
    assert sync.calls == 5


def test_cpu_has_nothing_to_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_CLUSTER_STEP_PROFILE", "1")
    assert device_synchronizer(torch.device("cpu")) is None
    timer = StepTimer(sync=None)
    run_step(timer)
    assert not timer.syncs_device


def test_reset_clears_the_totals() -> None:
    timer = StepTimer()
    run_step(timer)
    timer.reset()
    assert dict(timer.totals) == {}
