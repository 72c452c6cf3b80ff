"""What a Serve replica can learn about itself from Serve (the ingress and the ``LLMServer``
fronts both drain on it), whether the cluster's GCS is gone for good, and the two places where
the ingress reaches into Ray's process (its SIGTERM, the socket options of its own port)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("llm_cluster.serve")


def serve_stop_flag() -> Callable[[], bool] | None:
    """A function telling whether Serve has started stopping this replica, or None outside a
    replica. Serve (2.x) has no public hook for that moment — only ``__del__``, which it calls
    after the in-flight requests are gone — so this reads the replica's own ``_shutting_down``
    flag, reached through the replica context. If a Ray upgrade moves it, this returns None,
    the replica logs a warning and falls back to Serve's plain drain (in-flight requests past
    the deadline are cut, the ingress reports them as 503), and the drain test of
    ``tests/cluster/serving/test_serve_faults.py`` fails first."""
    try:
        from ray.serve.context import _get_internal_replica_context

        context = _get_internal_replica_context()
    except Exception:  # not in a replica, or Serve's layout changed
        return None
    if context is None:
        return None
    callback = getattr(context, "_handle_registration_callback", None)
    for cell in getattr(callback, "__closure__", None) or ():
        replica = cell.cell_contents
        is_replica = type(replica).__module__ == "ray.serve._private.replica"
        if is_replica and isinstance(getattr(replica, "_shutting_down", None), bool):
            return lambda: bool(replica._shutting_down)
    logger.warning("cannot observe Serve's replica shutdown: graceful drain falls back to "
                   "Serve's own (requests past graceful_shutdown_timeout_s are cut)")  # fmt: skip
    return None


def on_sigterm(callback: Callable[[], None]) -> bool:
    """Run ``callback`` on this Ray worker's main thread when the worker gets SIGTERM, before
    Ray's handler makes it exit (the replica's event loop still runs meanwhile). A raylet that
    stops (its node's ``ray stop``, or cluster serve's process group signalled) SIGTERMs every
    worker at once; this is the replica's only moment to finish what it carries. Ray's handler
    calls ``ray._private.worker.raise_sys_exit_with_custom_error_message`` by its module-global
    name, so that name is wrapped; False (with a warning) when a Ray upgrade moved it."""
    try:
        import ray._private.worker as ray_worker

        current = ray_worker.raise_sys_exit_with_custom_error_message
    except (ImportError, AttributeError):
        logger.warning("cannot hook SIGTERM in this Ray: streams end when the process does")
        return False
    hooks = getattr(current, "llm_cluster_sigterm_hooks", None)
    if hooks is None:
        hooks = []

        def run_hooks_then_exit(*args: object, **kwargs: object) -> object:
            for hook in hooks:
                try:
                    hook()
                except Exception:
                    logger.exception("SIGTERM hook %r failed", hook)
            return current(*args, **kwargs)

        run_hooks_then_exit.llm_cluster_sigterm_hooks = hooks  # type: ignore[attr-defined]
        ray_worker.raise_sys_exit_with_custom_error_message = run_hooks_then_exit
    hooks.append(callback)
    return True


def reuse_address_on_direct_ingress() -> bool:
    """Have Serve bind this replica's direct-ingress HTTP port (``cluster serve``'s own port)
    with SO_REUSEADDR, as its proxies, uvicorn and gRPC bind theirs. Without it, connections
    this server closed first (keep-alive clients at a stop) sit in TIME-WAIT on the port for a
    minute, and no server, not even one with SO_REUSEADDR, can bind it meanwhile: a restarted
    ``cluster serve`` was refused ("is in use"). Serve binds it in ``start_asgi_http_server``,
    which sets socket options only with ``enable_so_reuseport`` (SO_REUSEADDR and SO_REUSEPORT,
    the latter letting a second server share the port) and direct ingress turns that off; so,
    in this process only, that helper sets SO_REUSEADDR alone and the replica's call asks for
    it. Call in the replica's constructor: Serve starts the server after it. False (with a
    warning) when a Ray upgrade moved either name."""
    try:
        from ray.serve._private import http_util, replica
    except ImportError:
        replica = None
    start = getattr(replica, "start_asgi_http_server", None)
    if start is None or not hasattr(http_util, "set_socket_reuse_port"):
        logger.warning("cannot set SO_REUSEADDR on Serve's direct-ingress port: a restart may "
                       "find it in TIME-WAIT for a minute")  # fmt: skip
        return False
    if getattr(start, "llm_cluster_reuse_address", False):
        return True

    async def start_with_reuse_address(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_so_reuseport"] = True  # through the helper below: SO_REUSEADDR only
        return await start(*args, **kwargs)

    start_with_reuse_address.llm_cluster_reuse_address = True  # type: ignore[attr-defined]
    http_util.set_socket_reuse_port = _set_reuse_address
    replica.start_asgi_http_server = start_with_reuse_address
    return True


def _set_reuse_address(sock: socket.socket) -> bool:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return True


# Set by ``cluster serve`` in the environment of the local Ray it starts (its replicas inherit
# it): there the GCS keeps no state outside its process, so a GCS that refuses connections is
# the cluster stopping (the signal reached the whole process group or cgroup), not a restart.
ABORT_ON_GCS_LOSS_ENV = "LLM_CLUSTER_ABORT_ON_GCS_LOSS"


def gcs_loss_flag() -> Callable[[], Awaitable[bool]] | None:
    """Where ``ABORT_ON_GCS_LOSS_ENV`` is set: an async check that the GCS refuses connections
    (its process has exited; Ray's raylet ends this process a few seconds later). None
    elsewhere: a cluster whose GCS restarts (GCS fault tolerance) keeps its streams."""
    if os.environ.get(ABORT_ON_GCS_LOSS_ENV) != "1":
        return None
    import ray

    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:  # not connected to Ray
        return None
    return lambda: gcs_refuses(address)


async def gcs_refuses(gcs_address: str, timeout_s: float = 1.0) -> bool:
    """Whether ``host:port`` refuses a TCP connection; a slow answer is not a refusal."""
    host, _, port = gcs_address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    return False


__all__ = [
    "ABORT_ON_GCS_LOSS_ENV",
    "gcs_loss_flag",
    "gcs_refuses",
    "on_sigterm",
    "reuse_address_on_direct_ingress",
    "serve_stop_flag",
]
