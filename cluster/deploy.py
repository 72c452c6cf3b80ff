"""Deploying a config to a Ray cluster, and asking it how it is doing: what ``cluster serve``,
``deploy``, ``status`` and ``shutdown`` do, as functions tests can call too."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import serve

from cluster.config import DeploymentConfig
from cluster.serve import INGRESS_NAME, build_app, deployment_name, runtime_env

GRPC_SERVICER = "cluster.proto.llm_pb2_grpc.add_LLMServicer_to_server"

logger = logging.getLogger("llm_cluster.deploy")


def connect(address: str | None, log_to_driver: bool = False, num_cpus: float = 0) -> None:
    """Join the cluster at ``address`` ("auto": the one on this machine), start a new local
    one for "local" (with token authentication), or for None do what ``ray.init()`` does (join
    the cluster ``ray start`` made here, else start one). The driver carries this project's
    environment (runtime_env). A new local cluster offers at least ``num_cpus`` logical CPUs
    (more than the machine's cores when the config's bundles need them: a laptop runs every
    replica's front, head and workers, oversubscribed)."""
    if ray.is_initialized():
        return
    extra: dict[str, Any] = {}
    if address == "local":
        _token_auth_for_a_new_cluster()
        extra["num_cpus"] = max(os.cpu_count() or 1, math.ceil(num_cpus))
    elif address is not None:
        _token_auth_if_available()
    ray.init(
        address=address,
        namespace="llm-cluster",
        include_dashboard=False if address in (None, "local") else None,
        runtime_env=runtime_env() or None,
        logging_level="WARNING",
        log_to_driver=log_to_driver,
        **extra,
    )


def _token_auth_for_a_new_cluster() -> None:
    """The local cluster ``cluster serve`` starts requires Ray's token authentication: every
    connection to it (GCS, raylets, dashboard) must present the token in ~/.ray/auth_token
    (made on first use), so nobody else who reaches its ports can run code on it. Ray >= 2.5x
    does this by default for a new cluster; asking explicitly keeps it so if that default
    changes. An explicit ``RAY_AUTH_MODE`` is the operator's choice: respected, with a warning
    when it turns authentication off."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            enable_token_auth_by_default,
        )
    except ImportError:  # a Ray without token authentication
        logger.warning("this Ray has no token authentication: keep its ports off the network")
        return
    if not enable_token_auth_by_default():
        logger.warning(
            "RAY_AUTH_MODE=%s: the local Ray cluster runs without token authentication",
            os.environ.get("RAY_AUTH_MODE"),
        )


def _token_auth_if_available() -> None:
    """``ray start`` (Ray >= 2.5x) turns on token authentication and keeps the token in
    ~/.ray/auth_token, but a driver joining by address stays in 'disabled' mode unless told.
    Do what a local ``ray.init()`` does: token mode when RAY_AUTH_MODE is unset and a token is
    available. The helper is Ray's own (private, hence the guard)."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


# Ray Serve's switches for direct ingress: the ingress replica serves HTTP (and gRPC) itself.
_DIRECT_OFF = ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_ENABLE_DIRECT_INGRESS")


def direct_ingress(config: DeploymentConfig) -> DeploymentConfig | None:
    """Set up the environment of a local Ray about to start (call before ``connect("local")``)
    so that the ingress replica itself serves the config's HTTP (and gRPC) port: Ray Serve's
    throughput-optimized mode (``RAY_SERVE_THROUGHPUT_OPTIMIZED``: direct ingress, gRPC
    between replicas, user code on each replica's event loop), with the direct-ingress port
    range pinned to the config's ports. That removes the proxy hop — one Ray stream item per
    request per token, ~20 % of a core at 64 streams on a 2-core machine (BENCHMARKS.md,
    "Serving path"). Serve's proxies still run, on spare ports, idle. One ingress replica, no
    load balancer in front: no draining period. Returns the config to deploy (its ports are
    the proxies'), or None when the environment turns it off (either switch set to 0)."""
    if any(os.environ.get(name) == "0" for name in _DIRECT_OFF):
        return None
    http = config.http_options
    env = {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http.port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http.port + 1),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }
    grpc = config.grpc_options
    if grpc is not None:
        env["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"] = str(grpc.port)
        env["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"] = str(grpc.port + 1)
        grpc = dataclasses.replace(grpc, port=spare_port())
    os.environ.update(env)
    http = dataclasses.replace(http, port=spare_port())
    return dataclasses.replace(config, http_options=http, grpc_options=grpc)


def spare_port() -> int:
    """A free TCP port (for a proxy nobody calls; the tests' ports), between Ray's worker ports
    (10002-19999) and the OS's ephemeral range, where Ray's own servers take ports at any time
    (a port the OS handed out there was once taken by Ray before the proxy could bind it)."""
    for _ in range(200):
        port = random.randint(20000, 29999)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port in 20000-29999")


def wait_for_port(host: str, port: int, timeout_s: float = 60.0) -> None:
    """Wait until ``host:port`` accepts connections (the ingress replica's own server)."""
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            sock.settimeout(1.0)
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(
        f"nothing serves {host}:{port} after {timeout_s:.0f} s; is another process using it? "
        "Ingress logs: /tmp/ray/session_latest/logs/serve/replica_llm_OpenAIIngress_*.log"
    )


def start_serve(config: DeploymentConfig) -> None:
    """Start Serve's proxies with the config's ports; a running Serve keeps its own ports."""
    grpc_options = None
    if config.grpc_options is not None:
        grpc_options = {
            "port": config.grpc_options.port,
            "grpc_servicer_functions": [GRPC_SERVICER],
        }
    serve.start(
        http_options={"host": config.http_options.host, "port": config.http_options.port},
        grpc_options=grpc_options,
    )


def deploy(
    config: DeploymentConfig,
    progress: Callable[[str], None] = print,
    poll_s: float = 2.0,
    route_prefix: str = "/",
) -> None:
    """Deploy (or update in place: same app name) and wait until every deployment runs.
    Prints each deployment's status as it changes while the models load."""
    app = build_app(config)
    start_serve(config)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            serve.run(app, name=config.app_name, route_prefix=route_prefix)
        except BaseException as exc:  # reported below, in the calling thread
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    last: dict[str, str] = {}
    while worker.is_alive():
        worker.join(poll_s)
        current = deployment_states(config.app_name)
        for name, state in current.items():
            if last.get(name) != state:
                progress(f"  {name}: {state}")
        last = current
    if errors:
        raise errors[0]
    wait_for_proxies(config)


def wait_for_proxies(config: DeploymentConfig, timeout_s: float = 120.0) -> None:
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
    ports = f"HTTP port {config.http_options.port}"
    if config.grpc_options is not None:
        ports += f", gRPC port {config.grpc_options.port}"
    raise RuntimeError(
        f"Serve's proxies are not serving after {timeout_s:.0f} s ({proxies or 'none started'}); "
        f"is another process using the {ports}? "
        "Proxy logs: /tmp/ray/session_latest/logs/serve/proxy_*.log"
    )


def deployment_states(app_name: str) -> dict[str, str]:
    app = serve.status().applications.get(app_name)
    if app is None:
        return {}
    return {
        name: f"{d.status.value} {_replica_summary(d.replica_states)}".strip()
        for name, d in app.deployments.items()
    }


def _replica_summary(replica_states: dict[Any, int]) -> str:
    parts = [f"{n} {getattr(s, 'value', s).lower()}" for s, n in replica_states.items() if n]
    return f"({', '.join(parts)})" if parts else ""


def endpoint(config: DeploymentConfig) -> str:
    host = config.http_options.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{host}:{config.http_options.port}/v1"


def cluster_status(app_name: str = "llm") -> dict[str, Any]:
    """Per model: Serve's deployment status, replica states, and one replica's engine stats
    (KV usage, running and waiting requests)."""
    apps = serve.status().applications
    if app_name not in apps:
        return {"app": app_name, "status": "NOT_DEPLOYED", "models": {}}
    app = apps[app_name]
    models: dict[str, Any] = {}
    ingress = serve.get_deployment_handle(INGRESS_NAME, app_name)
    for name, dep in app.deployments.items():
        if not name.startswith("LLMServer:"):
            continue
        entry: dict[str, Any] = {
            "deployment": name,
            "status": dep.status.value,
            "replicas": {getattr(s, "value", str(s)): n for s, n in dep.replica_states.items()},
        }
        try:
            stats = _model_stats(ingress, name)
            entry["stats"] = stats
        except Exception as exc:  # a model with no running replica has no stats to show
            entry["stats_error"] = f"{type(exc).__name__}: {exc}"
        models[entry.get("stats", {}).get("model_id") or name.removeprefix("LLMServer:")] = entry
    return {"app": app_name, "status": app.status.value, "models": models}


def _model_stats(ingress: Any, deployment: str) -> dict[str, Any]:
    handle = serve.get_deployment_handle(deployment, ingress.app_name)
    return handle.stats.remote().result(timeout_s=30)


def wait_healthy(app_name: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        if app is not None and app.status.value == "RUNNING":
            return
        time.sleep(1.0)
    raise TimeoutError(f"application {app_name!r} not RUNNING after {timeout_s:.0f} s")


__all__ = [
    "cluster_status",
    "connect",
    "deploy",
    "deployment_name",
    "endpoint",
    "start_serve",
    "wait_for_proxies",
    "wait_healthy",
]


def shutdown() -> None:
    """Remove every application, then stop Serve. Applications are deleted first, one by one
    and waiting for each: that is what lets their replicas drain (in-flight requests finish
    within ``graceful_shutdown_timeout_s``, the rest end with finish_reason "abort") while the
    proxy still carries their streams; ``serve.shutdown`` alone tears the proxy down with them."""
    for app_name in list(serve.status().applications):
        serve.delete(app_name)
    serve.shutdown()
