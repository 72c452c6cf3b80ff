"""How ``cluster serve`` takes a stop (``cluster.ops.stop``), without a cluster: SIGINT and
SIGTERM raise ``StopRequested`` while it starts and only set the request once it serves; the
exit codes; and a local Ray's processes started apart from this process's group."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from cluster.ops.stop import StopRequested, StopSignals, ray_processes_apart


@pytest.fixture
def signals() -> Iterator[StopSignals]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield StopSignals()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_starting_raises_stop_requested_once(
    signals: StopSignals, sig: signal.Signals
) -> None:
    with pytest.raises(StopRequested) as stop:
        signal.raise_signal(sig)
    assert stop.value.signum == sig
    assert signals.requested.is_set()
    signal.raise_signal(signal.SIGTERM)  # a second one while stopping is recorded, not raised
    assert signals.signum == sig


def test_a_signal_while_serving_only_requests_the_stop(signals: StopSignals) -> None:
    signals.serving()
    signal.raise_signal(signal.SIGTERM)
    assert signals.requested.is_set() and signals.signum == signal.SIGTERM


def test_install_takes_the_signals_back_from_another_handler(signals: StopSignals) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what ray.init does, with its own handler
    signals.install()
    with pytest.raises(StopRequested):
        signal.raise_signal(signal.SIGTERM)


def test_exit_codes_are_130_for_ctrl_c_and_0_for_sigterm() -> None:
    assert StopSignals.exit_code(signal.SIGINT) == 130
    assert StopSignals.exit_code(signal.SIGTERM) == 0


def test_processes_ray_starts_meanwhile_lead_their_own_process_group() -> None:
    from ray._private import services

    launcher = services.ConsolePopen
    with ray_processes_apart() as apart:
        assert apart
        child = services.ConsolePopen(["sleep", "30"])
    try:
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
        assert services.ConsolePopen is launcher  # only while Ray starts
    finally:
        child.kill()
        child.wait()
