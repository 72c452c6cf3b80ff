"""How ``cluster serve`` takes a stop (``cluster.ops.stop``), without a cluster: SIGINT and
SIGTERM raise ``StopRequested`` while it starts and only set the request once it serves; the
exit codes; a local Ray's processes started apart from this process's group; and the drain
against a GCS that listens (a real socket) or refuses (a port nothing holds)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from cluster.ops.stop import (
    StopRequested,
    StopSignals,
    drain_unless_gcs_gone,
    ray_processes_apart,
)


@pytest.fixture
def signals() -> Iterator[StopSignals]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
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


def test_exit_codes_are_130_for_ctrl_c_0_for_sigterm_and_129_for_a_hang_up() -> None:
    assert StopSignals.exit_code(signal.SIGINT) == 130
    assert StopSignals.exit_code(signal.SIGTERM) == 0
    assert StopSignals.exit_code(signal.SIGHUP) == 129


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


@pytest.fixture
def listening_gcs() -> Iterator[str]:
    """A GCS address something listens on (the GCS is there)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"127.0.0.1:{server.getsockname()[1]}"


@pytest.fixture
def gone_gcs() -> str:
    """A GCS address that refuses connections (its process has exited)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_a_drain_that_finishes_is_true(listening_gcs: str) -> None:
    drained = []
    assert drain_unless_gcs_gone(lambda: drained.append(1), listening_gcs) is True
    assert drained == [1]


def test_a_drain_waiting_on_a_gone_gcs_is_left_to_its_thread(gone_gcs: str) -> None:
    release = threading.Event()
    started = time.monotonic()
    try:
        assert drain_unless_gcs_gone(lambda: release.wait(30), gone_gcs) is False
    finally:
        release.set()
    assert time.monotonic() - started < 5


def test_a_drain_failing_at_once_as_the_gcs_stops_is_no_drain_either(gone_gcs: str) -> None:
    """What a cgroup kill does on a loaded machine: the GCS, stopping, fails the drain's first
    call before it refuses connections. That is the same stop without a drain, not an error
    (raised, it would leave the driver in Ray's excepthook, which waits on the dead GCS)."""

    def drain() -> None:
        raise RuntimeError("Timed out while waiting for GCS to become available.")

    assert drain_unless_gcs_gone(drain, gone_gcs) is False


def test_a_drain_failing_with_the_gcs_there_raises_its_error(listening_gcs: str) -> None:
    def drain() -> None:
        raise RuntimeError("the drain's own error")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the drain's own error"):
        drain_unless_gcs_gone(drain, listening_gcs, settle_s=0.5)
    assert time.monotonic() - started >= 0.5  # the GCS was given time to go first
