"""Stopping ``cluster serve``: one signal, one orderly stop, whatever it reached.

    Ctrl-C, SIGTERM,  ──▶ cluster serve ──▶ drain: Serve stops the replicas; requests in flight
    SIGHUP (to it, or     (the driver)      finish, or end with "abort" and [DONE]
    to its process group)               ──▶ stop Ray ──▶ wait until the ports are free ──▶ exit 0
    Ray's own processes (GCS, raylet, agents) lead process groups of their own.

A signal to ``cluster serve``'s process group (Ctrl-C in a terminal, ``kill -TERM -PGID``) reaches
the driver alone: a raylet that got it would SIGTERM every worker and exit within ~50 ms, and a
worker exits the moment its raylet is gone, the ingress with its streams half written
(RELIABILITY.md, "Stopping and restarting"). So every stop is the drain, and the driver stops
Ray only after it.

``StopSignals`` turns SIGINT, SIGTERM and SIGHUP (its terminal closed) into that stop: while
``cluster serve`` starts, by raising ``StopRequested`` wherever the main thread waits (so a stop
mid-deploy removes what was started); once it serves, by setting an event. Where a signal reaches
Ray's processes too (a kill of the whole cgroup, systemd's default ``KillMode=control-group``) the
GCS stops at once and a drain through it would wait 60 s on Ray's reconnection, or fail at once
(raised, that error would leave the driver in Ray's excepthook, which waits on the GCS):
``drain_unless_gcs_gone`` notices either, the replicas abort their requests on their own
(``cluster.serving.serve_replica.gcs_loss_flag``), and ``exit_without_ray`` ends the driver within
seconds. That path cannot promise every stream its ending (the raylet may stop the workers first):
``docs/deploy.md`` says to signal the main process alone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NoReturn

from cluster.ops.ports import can_bind
from cluster.serving.serve_replica import ABORT_ON_GCS_LOSS_ENV

logger = logging.getLogger("llm_cluster.stop")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRequested(BaseException):
    """A stop signal arrived while ``cluster serve`` was starting (a BaseException, like
    KeyboardInterrupt: no ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP as a request to stop ``cluster serve`` (installed on the main
    thread). ``starting`` (the default): the first signal raises ``StopRequested`` in the main
    thread; after ``serving()`` it only sets ``requested``. Later signals are recorded, never
    raised. ``ray.init`` installs Ray's own SIGTERM handler (and a C++ one that dumps a stack and
    aborts): call ``install()`` again once it has returned.

    SIGHUP is left ignored where it was ignored at start (``nohup``). On a hang-up the terminal
    is gone and writing to it fails (EIO): the standard streams that were that terminal are
    pointed at ``/dev/null`` first, so the drain's messages cannot break the stop."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.signum: int | None = None
        self._raise = True
        self._signals = tuple(
            sig
            for sig in STOP_SIGNALS
            if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN
        )
        self.install()

    def install(self) -> None:
        for sig in self._signals:
            signal.signal(sig, self._on_signal)

    def serving(self) -> None:
        """From now on a signal sets ``requested`` (the drain runs in the main flow)."""
        self._raise = False
        self.install()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            _detach_from_terminal()
        first = self.signum is None
        if first:
            self.signum = signum
        self.requested.set()
        if first and self._raise:
            self._raise = False
            raise StopRequested(signum)

    @staticmethod
    def exit_code(signum: int) -> int:
        """0 for SIGTERM (a stop asked for, done); a shell's 128 + the signal for the others:
        130 for Ctrl-C, 129 for a hang-up."""
        return 0 if signum == signal.SIGTERM else 128 + signum


def _detach_from_terminal() -> None:
    """Point stdin, stdout and stderr at ``/dev/null`` where they are a terminal (one that hung
    up answers every write with EIO)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            if _is_terminal(fd):
                os.dup2(null, fd)
    finally:
        os.close(null)


def _is_terminal(fd: int) -> bool:
    """Whether ``fd`` is a terminal, one that hung up included (``isatty`` says no to those:
    their ioctls fail with EIO)."""
    import termios

    try:
        termios.tcgetattr(fd)
    except termios.error as exc:
        return exc.args[0] == errno.EIO
    except (OSError, ValueError):
        return False
    return True


@contextlib.contextmanager
def ray_processes_apart() -> Iterator[bool]:
    """While a new local Ray starts (around ``ray.init``): each process it launches (GCS, raylet,
    log monitor; the raylet's agents follow the raylet) leads a process group of its own, so a
    signal to this process's group reaches this process alone and it drains. Ray does the same
    on Windows; it needs kernel fate-sharing (Linux: the child dies with its parent), or a
    killed driver would leave Ray running, so it is done only where Ray detects that. Ray has no
    option for it: its process launcher (``services.ConsolePopen``) is wrapped for the duration.
    Yields False, with a warning, where that launcher moved or fate-sharing is missing."""
    try:
        from ray._private import services, utils

        launcher = services.ConsolePopen
        apart = utils.detect_fate_sharing_support() and sys.platform.startswith("linux")
    except (ImportError, AttributeError):
        apart = False
    if not apart:
        logger.warning("Ray's processes share this process group: a signal to the group stops "
                       "Ray with this process, without a drain")  # fmt: skip
        yield False
        return

    class ApartPopen(launcher):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    services.ConsolePopen = ApartPopen
    try:
        yield True
    finally:
        services.ConsolePopen = launcher


def gcs_gone(gcs_address: str, timeout_s: float = 0.5) -> bool:
    """Whether the GCS at ``host:port`` refuses connections: its process has exited. A slow
    answer is not "gone" (a loaded machine), only a refusal is."""
    host, _, port = gcs_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def drain_unless_gcs_gone(
    drain: Callable[[], None],
    gcs_address: str,
    poll_s: float = 0.2,
    refusals: int = 2,
    settle_s: float = 3.0,
) -> bool:
    """Run ``drain`` (``deploy.shutdown``); True when it finished, False as soon as the GCS
    refused ``refusals`` connections in a row (the drain is left to its thread). A drain that
    failed is looked at for up to ``settle_s`` more: a GCS stopping with this process fails
    the drain's first call at once, before it refuses connections, and that is the same
    False; a drain's error with the GCS still there is raised."""
    finished = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            drain()
        except BaseException as exc:
            errors.append(exc)
        finally:
            finished.set()

    threading.Thread(target=run, name="drain", daemon=True).start()
    refused = 0
    while not finished.wait(poll_s):
        refused = refused + 1 if gcs_gone(gcs_address) else 0
        if refused >= refusals:
            return False
    if not errors:
        return True
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        refused = refused + 1 if gcs_gone(gcs_address) else 0
        if refused >= refusals:
            logger.info("the drain failed with the GCS gone: %r", errors[0])
            return False
        time.sleep(poll_s)
    raise errors[0]


def abort_streams_on_gcs_loss() -> None:
    """For the local Ray about to start (call before ``connect("local")``; its processes
    inherit the environment): model replicas abort their requests once its GCS is gone
    (``cluster.serving.serve_replica.gcs_loss_flag``)."""
    os.environ[ABORT_ON_GCS_LOSS_ENV] = "1"


def local_ray_started() -> bool:
    """Whether this driver started a local Ray, even one whose ``ray.init`` was interrupted
    before it connected (Ray's node object is private: False where it moved)."""
    try:
        from ray._private.worker import _global_node
    except ImportError:
        return False
    return _global_node is not None


def stop_local_ray(ports: list[tuple[str, str, int]], timeout_s: float = 15.0) -> list[int]:
    """Stop the local Ray this driver started (its raylet ends every worker with it) and wait,
    up to ``timeout_s``, until nothing listens on ``ports`` any more (``cluster.ops.ports``'s
    ``(field, host, port)``), so that a ``cluster serve`` started right after can bind them.
    Returns the ports still held at the deadline."""
    import ray

    ray.shutdown()
    deadline = time.monotonic() + timeout_s
    held = [port for _, host, port in ports if not can_bind(host, port)]
    while held and time.monotonic() < deadline:
        time.sleep(0.1)
        held = [port for _, host, port in ports if not can_bind(host, port)]
    return held


def exit_without_ray(code: int = 0, streams_grace_s: float = 4.0, grace_s: float = 2.0) -> NoReturn:
    """Exit now, with the local Ray's GCS gone. Its raylet still runs for a few seconds, and
    with it the replicas, which end their streams (finish_reason "abort") on seeing the GCS
    gone; ``ray.shutdown`` would kill the raylet, and every worker with it, at once. So first
    wait for the raylet to exit on its own (up to ``streams_grace_s``), then ``ray.shutdown``
    (kills what this driver started that still runs) for up to ``grace_s``, since its
    disconnect may wait on the dead GCS; then end without the atexit hooks that would wait on it
    again."""
    import ray

    _wait_for_local_raylet(streams_grace_s)
    stopper = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    stopper.start()
    stopper.join(grace_s)
    # Not logging.shutdown(): the abandoned drain thread may hold a handler's lock.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _wait_for_local_raylet(timeout_s: float) -> None:
    """Wait for the raylet this driver started (``ray.init`` of a local cluster) to exit; Ray's
    node object is private, so without it this waits the whole ``timeout_s``."""
    try:
        from ray._private import ray_constants
        from ray._private.worker import _global_node

        raylet = _global_node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
    except Exception:
        time.sleep(timeout_s)
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        raylet.wait(timeout_s)


__all__ = [
    "STOP_SIGNALS",
    "StopRequested",
    "StopSignals",
    "abort_streams_on_gcs_loss",
    "drain_unless_gcs_gone",
    "exit_without_ray",
    "gcs_gone",
    "local_ray_started",
    "ray_processes_apart",
    "stop_local_ray",
]
