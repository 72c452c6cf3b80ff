"""Deploying a config to a Ray cluster, and asking it how it is doing: what ``cluster serve``,
``deploy``, ``status`` and ``shutdown`` do, as functions tests can call too."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import socket
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import serve

from cluster.config import DeploymentConfig
from cluster.ops.capacity import report_shortfalls
from cluster.ops.plan import preflight
from cluster.ops.serve_proxies import serve_controller, serve_start, wait_for_proxies
from cluster.ops.stop import ray_processes_apart
from cluster.runtime.load_progress import describe, read_load_progress
from cluster.serving.responses_store import remove_store
from cluster.serving.serve import build_app, deployment_name, runtime_env
from cluster.serving.start_errors import start_failure
from engine.startup_timeline import StartupTimeline

GRPC_SERVICER = "cluster.proto.llm_pb2_grpc.add_LLMServicer_to_server"

logger = logging.getLogger("llm_cluster.deploy")


def connect(address: str | None, log_to_driver: bool = False, num_cpus: float = 0) -> None:
    """Join the cluster at ``address`` ("auto": the one on this machine), start a new local
    one for "local" (with token authentication; its processes apart from this process's group:
    ``cluster.ops.stop.ray_processes_apart``), or for None do what ``ray.init()`` does (join
    the cluster ``ray start`` made here, else start one). The driver carries this project's
    environment (runtime_env). A new local cluster offers at least ``num_cpus`` logical CPUs
    (more than the machine's cores when the config's bundles need them: a laptop runs every
    replica's front, head and workers, oversubscribed)."""
    if ray.is_initialized():
        return
    extra: dict[str, Any] = {}
    starting = contextlib.nullcontext()
    if address == "local":
        _token_auth_for_a_new_cluster()
        extra["num_cpus"] = max(os.cpu_count() or 1, math.ceil(num_cpus))
        starting = ray_processes_apart()  # a signal to our process group stops us, not Ray
    elif address is not None:
        _token_auth_if_available()
    with starting:
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
    the proxies'), or None when the environment turns it off (either switch set to 0) or the
    config asks for several ingress replicas (``http_options.ingress_replicas``: one port can
    be one replica's only, so those go behind Serve's proxy)."""
    if any(os.environ.get(name) == "0" for name in _DIRECT_OFF):
        return None
    if config.http_options.ingress_replicas > 1:
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
    """Start Serve's proxies with the config's ports. Serve's HTTP and gRPC options are the
    cluster's, fixed once Serve runs (``serve.start`` then keeps them and only logs that the new
    ones are ignored): a running Serve whose options differ from the config's raises
    ``DeployError`` naming each field, before anything is deployed."""
    grpc_options = None
    if config.grpc_options is not None:
        grpc_options = {
            "port": config.grpc_options.port,
            "grpc_servicer_functions": [GRPC_SERVICER],
        }
    http = config.http_options
    http_options: dict[str, Any] = {"host": http.host, "port": http.port}
    if http.request_timeout_s is not None:  # Serve's end-to-end timeout (408), proxy or not
        http_options["request_timeout_s"] = http.request_timeout_s
    running = _running_serve_options()
    if running is not None:
        differences = serve_option_differences(config, http_options, *running)
        if differences:
            raise DeployError(config.app_name, differences)
    serve_start(http_options=http_options, grpc_options=grpc_options)


def _running_serve_options() -> tuple[Any, Any] | None:
    """The running Serve's ``HTTPOptions`` and ``gRPCOptions`` (its controller's), or None when
    Serve does not run on the connected cluster (or no cluster is connected)."""
    if not ray.is_initialized():
        return None
    controller = serve_controller()
    if controller is None:
        return None
    http, grpc = ray.get([controller.get_http_config.remote(), controller.get_grpc_config.remote()])
    return http, grpc


def serve_option_differences(
    config: DeploymentConfig, http_options: dict[str, Any], running_http: Any, running_grpc: Any
) -> dict[str, str]:
    """Field -> how the running Serve's options (``running_http``: ``HTTPOptions``,
    ``running_grpc``: ``gRPCOptions``) differ from what the config asks ``serve.start`` for
    (``http_options``, Serve's defaults filled in); empty when they agree. gRPC counts as
    served only with this project's servicer."""
    from ray.serve.config import HTTPOptions

    wanted = HTTPOptions.model_validate(http_options)
    found = {
        f"http_options.{key}": (getattr(running_http, key), getattr(wanted, key))
        for key in ("host", "port", "request_timeout_s")
    }
    serving_grpc = GRPC_SERVICER in (running_grpc.grpc_servicer_functions or [])
    running_port = running_grpc.port if serving_grpc else None
    config_port = config.grpc_options.port if config.grpc_options is not None else None
    found["grpc_options.port"] = (running_port, config_port)
    return {
        field: _option_difference(field, running, wanted)
        for field, (running, wanted) in found.items()
        if running != wanted
    }


def _option_difference(field: str, running: Any, wanted: Any) -> str:
    def shown(value: Any) -> str:
        if value is None:
            return "no gRPC" if field.startswith("grpc") else "none"
        return repr(value)

    if running is None:
        keep = f"remove {'grpc_options' if field.startswith('grpc') else field} from the config"
    else:
        keep = f"set {field} to {running!r} in the config"
    return (
        f"Serve already runs on this cluster with {field} {shown(running)}, the config has "
        f"{shown(wanted)}: Serve's HTTP and gRPC options are fixed while it runs; run "
        f"'cluster shutdown' first (it removes every application) to change them, or {keep}"
    )


class DeployError(RuntimeError):
    """A model's replicas cannot start, for a known cause: ``reasons`` maps each such model's
    deployment to "model 'm' cannot start: <reason>" (``cluster.serving.start_errors``); or
    the running Serve's options differ from the config's: ``reasons`` maps each such field
    (``http_options.port``) to how (``start_serve``)."""

    def __init__(self, app_name: str, reasons: dict[str, str]) -> None:
        super().__init__("; ".join(reasons.values()))
        self.app_name = app_name
        self.reasons = reasons

    def __reduce__(self) -> tuple[type[DeployError], tuple[str, dict[str, str]]]:
        return type(self), (self.app_name, self.reasons)


def deploy(
    config: DeploymentConfig,
    progress: Callable[[str], None] = print,
    poll_s: float = 2.0,
    route_prefix: str = "/",
    timeline: StartupTimeline | None = None,
) -> None:
    """Deploy (or update in place: same app name) and wait until every deployment runs.
    Prints each deployment's status as it changes while the models load.

    A replica that cannot start for a known cause (``cluster.serving.start_errors``: the engine
    refuses the checkpoint, a port in use, out of memory) raises ``DeployError`` as soon as
    Serve reports it, instead of after Serve's retries: a new application is deleted and its
    failure recorded for ``cluster_status``; an update leaves the running application to Serve
    (its replicas of the previous version keep serving).

    First of all, ``cluster.ops.plan.preflight``: a model that cannot fit its GPUs (weights, or a
    KV cache shorter than one max_model_len sequence) raises ``PlanError`` before anything is
    built, started or placed. While it waits, ``cluster.ops.capacity``: a replica the cluster's
    nodes (and its autoscaler's node types) cannot hold, e.g. a TP group larger than every
    node, is reported through ``progress`` with each node's capacity at once, instead of
    pending silently (it is placed if nodes join). ``timeline`` (``cluster serve``'s) gets a
    mark as Serve starts, the replicas run and the proxies serve."""
    timeline = timeline or StartupTimeline("deploy")
    preflight(config)
    app = build_app(config)
    start_serve(config)
    timeline.mark("serve start")
    name = config.app_name
    updating = name in serve.status().applications
    _submit(app, name, route_prefix)
    last: dict[str, str] = {}
    shortfalls: dict[str, str] = {}
    while True:
        shortfalls = report_shortfalls(config, progress, shortfalls)
        status = serve.status().applications.get(name)
        current = _deployment_states(status)
        for deployment, state in current.items():
            if last.get(deployment) != state:
                progress(f"  {deployment}: {state}")
        last = current
        failures = _start_failures(status)
        if failures:
            if not updating:  # stop Serve's retries: nothing of this app was serving
                serve.delete(name)
                _record_failure(name, failures)
            raise DeployError(name, failures)
        if status is None:
            raise RuntimeError(f"application {name!r} was removed while it was deploying")
        if status.status.value == "RUNNING":
            timeline.mark("replicas")
            break
        if status.status.value == "DEPLOY_FAILED":  # what serve.run raises
            raise RuntimeError(f"Deploying application {name} failed: {status.message}")
        time.sleep(poll_s)
    _forget_failure(name)
    grpc = config.grpc_options
    wait_for_proxies(config.http_options.port, None if grpc is None else grpc.port)
    timeline.mark("proxies")


def _submit(app: Any, name: str, route_prefix: str) -> None:
    """Hand the application to Serve without waiting for it to run (``deploy`` watches it)."""
    run_many = getattr(serve, "run_many", None)
    if run_many is None:  # a Ray before serve.run_many
        serve._run(app, _blocking=False, name=name, route_prefix=route_prefix)
        return
    target = serve.RunTarget(target=app, name=name, route_prefix=route_prefix)
    run_many([target], wait_for_applications_running=False)


def start_failures(app_name: str) -> dict[str, str]:
    """The app's model deployments whose replicas failed to start for a known cause, with
    the ``ModelStartError`` message Serve's status carries."""
    return _start_failures(serve.status().applications.get(app_name))


def _start_failures(app: Any) -> dict[str, str]:
    if app is None:
        return {}
    failures = {}
    for name, dep in app.deployments.items():
        reason = start_failure(dep.message)
        if name.startswith("LLMServer:") and reason is not None:
            failures[name] = reason
    return failures


# A new application that ``deploy`` deleted for a known start failure: its reasons, kept in
# the cluster's GCS (internal KV) so that ``cluster status`` can say why nothing is deployed.
# A later successful deploy of the app, or ``shutdown``, forgets it.
_KV_NAMESPACE = "llm-cluster"
_KV_FAILED_PREFIX = "deploy-failed:"


def _kv() -> Any:
    from ray.experimental import internal_kv  # private: guarded by every caller

    return internal_kv


def _record_failure(app_name: str, failures: dict[str, str]) -> None:
    try:
        record = json.dumps({"at": time.time(), "models": failures})
        _kv()._internal_kv_put(_KV_FAILED_PREFIX + app_name, record, namespace=_KV_NAMESPACE)
    except Exception:  # a Ray without internal KV: status then shows NOT_DEPLOYED only
        logger.warning("cannot record why app %r failed to deploy", app_name, exc_info=True)


def recorded_failure(app_name: str) -> dict[str, Any] | None:
    """What ``deploy`` recorded of the app's last failed (and deleted) deployment, or None."""
    try:
        raw = _kv()._internal_kv_get(_KV_FAILED_PREFIX + app_name, namespace=_KV_NAMESPACE)
    except Exception:
        return None
    return json.loads(raw) if raw else None


def _forget_failure(app_name: str | None = None) -> None:
    key = _KV_FAILED_PREFIX + (app_name or "")
    try:
        _kv()._internal_kv_del(key, del_by_prefix=app_name is None, namespace=_KV_NAMESPACE)
    except Exception:
        logger.debug("cannot forget failed deploys of %r", app_name, exc_info=True)


def deployment_states(app_name: str) -> dict[str, str]:
    return _deployment_states(serve.status().applications.get(app_name))


def _deployment_states(app: Any) -> dict[str, str]:
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
    """Per model: Serve's deployment status, replica states, one replica's engine stats (KV
    usage, running and waiting requests), and while replicas start, ``loading``: one entry per
    starting worker (rank, node, phase, GiB read / total, %, seconds;
    ``cluster.runtime.load_progress``)."""
    apps = serve.status().applications
    if app_name not in apps:
        return _not_deployed(app_name)
    app = apps[app_name]
    models: dict[str, Any] = {}
    loading = _loading_by_deployment()
    for name, dep in app.deployments.items():
        if not name.startswith("LLMServer:"):
            continue
        entry: dict[str, Any] = {
            "deployment": name,
            "status": dep.status.value,
            "replicas": {getattr(s, "value", str(s)): n for s, n in dep.replica_states.items()},
        }
        failure = start_failure(dep.message)
        if failure is not None:
            entry["error"] = failure
        if name in loading:
            entry["loading"] = loading[name]
        if not entry["replicas"].get("RUNNING"):
            # A call would wait (up to 30 s) for a replica to come up: not while one loads.
            entry["stats_error"] = "no running replica"
        else:
            try:
                entry["stats"] = _model_stats(app_name, name)
            except Exception as exc:  # the replica went away meanwhile
                entry["stats_error"] = f"{type(exc).__name__}: {exc}"
        models[entry.get("stats", {}).get("model_id") or name.removeprefix("LLMServer:")] = entry
    return {"app": app_name, "status": app.status.value, "models": models}


def _loading_by_deployment() -> dict[str, list[dict[str, Any]]]:
    """The fresh start-up records of every model's workers, keyed by its deployment name."""
    now = time.time()
    by_deployment: dict[str, list[dict[str, Any]]] = {}
    for record in read_load_progress(now=now):
        name = deployment_name(str(record.get("model_id", "")))
        by_deployment.setdefault(name, []).append(describe(record, now))
    return by_deployment


def _not_deployed(app_name: str) -> dict[str, Any]:
    """NOT_DEPLOYED; or DEPLOY_FAILED with each model's reason when ``deploy`` deleted the app
    because its replicas could not start (``removed``: nothing of it runs)."""
    failed = recorded_failure(app_name)
    if failed is None:
        return {"app": app_name, "status": "NOT_DEPLOYED", "models": {}}
    models = {
        name.removeprefix("LLMServer:"): {"deployment": name, "status": "DEPLOY_FAILED",
                                           "replicas": {}, "error": reason}
        for name, reason in failed["models"].items()
    }  # fmt: skip
    return {"app": app_name, "status": "DEPLOY_FAILED", "removed": True,
            "failed_at": failed["at"], "models": models}  # fmt: skip


def _model_stats(app_name: str, deployment: str) -> dict[str, Any]:
    # The deployment's own handle, taken only once it has a running replica: early in a
    # deploy Serve may not have registered the app's deployments yet (KeyError).
    handle = serve.get_deployment_handle(deployment, app_name)
    return handle.stats.remote().result(timeout_s=30)


def sleep_control(app_name: str, method: str, model: str, *args: Any) -> dict[str, Any]:
    """The ingress's ``sleep_model`` / ``wake_model`` / ``model_sleep_state`` for ``model``
    (every replica of it; the awake set of ``sleep_mode`` kept in step). Raises the ingress's
    ``APIError`` (unknown model, a bad level, requests in flight)."""
    from ray import serve

    from cluster.serving.serve import INGRESS_NAME

    handle = serve.get_deployment_handle(INGRESS_NAME, app_name)
    return getattr(handle, method).remote(model, *args).result()


def wait_healthy(app_name: str, timeout_s: float = 300.0) -> None:
    """Wait until the app runs; raises ``DeployError`` at once when a model's replicas cannot
    start for a known cause (the app is left as it is)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        if app is not None and app.status.value == "RUNNING":
            return
        failures = _start_failures(app)
        if failures:
            raise DeployError(app_name, failures)
        time.sleep(1.0)
    raise TimeoutError(f"application {app_name!r} not RUNNING after {timeout_s:.0f} s")


__all__ = [
    "DeployError",
    "cluster_status",
    "connect",
    "deploy",
    "deployed_apps",
    "deployment_name",
    "endpoint",
    "recorded_failure",
    "start_failures",
    "start_serve",
    "wait_healthy",
]


def shutdown(app_name: str | None = None) -> None:
    """Remove every application (or only ``app_name``, on a cluster others deploy to), then
    stop Serve unless an application is left. Applications are deleted first, one by one and
    waiting for each: that is what lets their replicas drain (in-flight requests finish within
    ``graceful_shutdown_timeout_s``, the rest end with finish_reason "abort") while the proxy
    still carries their streams; ``serve.shutdown`` alone tears the proxy down with them."""
    if serve_controller() is not None:
        apps = list(serve.status().applications)
        for name in apps if app_name is None else [a for a in apps if a == app_name]:
            serve.delete(name)
            remove_store(name)  # its /v1/responses store, a detached actor
        if not serve.status().applications:
            _stop_serve()
    _forget_failure(app_name)


def deployed_apps() -> list[str]:
    """The Serve applications on the cluster (none when Serve does not run)."""
    if serve_controller() is None:
        return []
    return list(serve.status().applications)


def _stop_serve(timeout_s: float = 30.0) -> None:
    """``serve.shutdown``, without its noise. The controller stops the proxies, then kills
    itself; ``serve.shutdown`` waits for that through a call Ray retries forever (the
    controller's ``max_task_retries``), and Ray then prints "Task ServeController.
    graceful_shutdown failed ... killed by `ray.kill`" on every clean stop. The same call
    without retries ends with the controller's death, quietly; ``serve.shutdown`` then only
    forgets its client."""
    controller = serve_controller()
    if controller is not None:
        stopping = controller.graceful_shutdown.options(max_task_retries=0).remote()
        with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            ray.get(stopping, timeout=timeout_s)
    serve_logger = logging.getLogger("ray.serve")
    level = serve_logger.level
    serve_logger.setLevel(logging.WARNING)  # "the cached controller has died", "nothing to ..."
    try:
        serve.shutdown()
    finally:
        serve_logger.setLevel(level)
