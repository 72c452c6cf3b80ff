"""Stopping ``cluster serve``: drain, unless the signal that asked for it stopped Ray too.

SIGTERM to the main process alone (``KillMode=mixed``, ``docker stop`` with an init, Kubernetes)
drains: in-flight requests finish within ``graceful_shutdown_timeout_s``, the rest end with
finish_reason "abort". SIGTERM to the whole process group or cgroup (systemd's default
``KillMode=control-group``, ``kill -TERM -PGID``) reaches Ray's GCS, raylet and workers as well;
the GCS exits at once, the raylet (and every worker with it) a few seconds later, and a drain
through the dead GCS would only wait on Ray's 60 s reconnection timeout before failing. So the
drain runs on a thread while the GCS's port is watched; once it refuses connections, the model
replicas, which watch it too, abort their requests (streams end with finish_reason "abort" and
``[DONE]`` while the raylet still runs), and ``cluster serve`` exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from cluster.serving.serve_replica import ABORT_ON_GCS_LOSS_ENV

logger = logging.getLogger("llm_cluster.stop")


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
    drain: Callable[[], None], gcs_address: str, poll_s: float = 0.2, refusals: int = 2
) -> bool:
    """Run ``drain`` (``deploy.shutdown``); True when it finished, False as soon as the GCS
    refused ``refusals`` connections in a row (the drain is left to its thread). A drain's
    own error is raised."""
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
    if errors:
        raise errors[0]
    return True


def abort_streams_on_gcs_loss() -> None:
    """For the local Ray about to start (call before ``connect("local")``; its processes
    inherit the environment): model replicas abort their requests once its GCS is gone
    (``cluster.serving.serve_replica.gcs_loss_flag``)."""
    os.environ[ABORT_ON_GCS_LOSS_ENV] = "1"


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


__all__ = ["abort_streams_on_gcs_loss", "drain_unless_gcs_gone", "exit_without_ray", "gcs_gone"]
