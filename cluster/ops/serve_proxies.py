"""Serve's controller and proxies on a busy machine: start Serve so that a first proxy its
controller replaces does not fail the start, and wait until every proxy serves. ``deploy``
starts Serve this way, and so do the tests' Serve clusters."""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray import serve

logger = logging.getLogger("llm_cluster.deploy")


def serve_controller() -> Any:
    """Serve's controller actor, or None when Serve does not run on this cluster."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return None


def serve_start(**options: Any) -> None:
    """``serve.start(**options)``. It waits for the first proxies; the controller kills one not
    ready after three checks (5 s each: a busy machine, Ray's workers at niceness 15) and starts
    another, and ``serve.start`` then raises ``ActorDiedError`` (or ``TimeoutError``) though
    Serve goes on. Only a controller that died too fails the start here; ``wait_for_proxies``
    waits for the replacement."""
    try:
        serve.start(**options)
    except (ray.exceptions.ActorDiedError, TimeoutError):
        if serve_controller() is None:
            raise
        logger.warning("Serve's controller replaced a proxy that was slow to start")


def wait_for_proxies(
    http_port: int, grpc_port: int | None = None, timeout_s: float = 120.0
) -> None:
    """Wait until every proxy serves. ``serve.run`` returns once the replicas run, but a proxy
    binds its HTTP (and gRPC) port on its own schedule, and one that cannot bind (the port is
    taken) restarts forever: "ready" must mean the port accepts requests."""
    deadline = time.monotonic() + timeout_s
    proxies: dict[str, Any] = {}
    while time.monotonic() < deadline:
        proxies = {node: getattr(s, "value", str(s)) for node, s in serve.status().proxies.items()}
        serving = [s for s in proxies.values() if s not in ("DRAINING", "DRAINED")]
        if serving and all(s == "HEALTHY" for s in serving):
            return
        time.sleep(0.5)
    ports = f"HTTP port {http_port}" + ("" if grpc_port is None else f", gRPC port {grpc_port}")
    raise RuntimeError(
        f"Serve's proxies are not serving after {timeout_s:.0f} s ({proxies or 'none started'}); "
        f"is another process using the {ports}? "
        "Proxy logs: /tmp/ray/session_latest/logs/serve/proxy_*.log"
    )
