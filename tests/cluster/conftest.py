"""A local Ray with Serve for the serving tests: started once per session, lazily, ports from
``free_port``.

Isolation between the tests that start a Ray of their own (``ray.init``, a
``ray.cluster_utils.Cluster``) and those sharing the session's Ray is explicit, not a matter of
file names: ``pytest_collection_modifyitems`` runs every test that uses ``serve_cluster`` after
all the others, so the shared Ray starts once the last module-owned one is gone and nothing
stops it before the session ends. (The one ``ray stop``, ending the CLI test's ``ray start``
head, stops every Ray on the machine: it runs before the shared one starts.)

The process ends with ``os._exit`` once pytest has reported and unconfigured (``pytest_unconfigure``
below), as ``cluster serve`` ends (``cluster.ops.stop.exit_without_ray``): twice, after every test
had passed, a Ray driver's interpreter exit died of SIGSEGV in native code (a thread jumping into
the heap, past Python's fault handler), which failed the run."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests on the session's shared Ray (``serve_cluster``, directly or through another
    fixture) last, in their collected order; the others keep theirs."""
    shared = [item for item in items if "serve_cluster" in getattr(item, "fixturenames", ())]
    if shared:
        own = [item for item in items if "serve_cluster" not in getattr(item, "fixturenames", ())]
        items[:] = own + shared


_SESSION = pytest.StashKey["pytest.Session"]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Exit with the session's status now, skipping the interpreter's and native libraries'
    teardown (the module docstring says why). Every report is written by now."""
    session = config.stash.get(_SESSION, None)
    if session is None:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(int(session.exitstatus))


def free_port() -> int:
    """A port free now, outside Ray's worker ports and the OS's ephemeral range (where Ray's own
    servers take random ports at any time): the same draw ``cluster serve`` makes for its idle
    proxies."""
    from cluster.ops.deploy import spare_port

    return spare_port()


def load_yaml(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / name).read_text())


def wait_for(
    predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.5
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def prompt_tokens(
    base_url: str,
    messages: list[dict[str, Any]],
    model: str = "tiny-llama",
    headers: Mapping[str, str] | None = None,
) -> int:
    """The chat template's token count for ``messages`` (the server's /tokenize)."""
    body = json.dumps({"model": model, "messages": messages}).encode()
    request = urllib.request.Request(
        f"{base_url}/tokenize", body, {"content-type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.load(reply)["count"]


# Health checked every second: a dead engine is noticed within a few seconds.
FAST_HEALTH_CHECKS = {
    "health_check_period_s": 1,
    "health_check_timeout_s": 10,
    "graceful_shutdown_timeout_s": 3,
}


def tiny_model(
    model_id: str, deployment: dict[str, Any] | None = None, **engine_kwargs: Any
) -> dict[str, Any]:
    """configs/tiny.yaml's model (``builtin:tiny-llama``) served as ``model_id``: these engine
    kwargs over its own, these deployment settings over its own."""
    base = load_yaml("tiny.yaml")["models"][0]
    return {
        "model_loading_config": {"model_id": model_id, "model_source": "builtin:tiny-llama"},
        "engine_kwargs": {**base["engine_kwargs"], **engine_kwargs},
        "deployment_config": {**base["deployment_config"], **(deployment or {})},
    }


def health_checked_model(model_id: str, **engine_kwargs: Any) -> dict[str, Any]:
    """``tiny_model`` for the fault tests: 2,048 positions unless told, ``FAST_HEALTH_CHECKS``."""
    return tiny_model(model_id, FAST_HEALTH_CHECKS, **{"max_model_len": 2048, **engine_kwargs})


@dataclass(frozen=True)
class ServeCluster:
    http_port: int
    grpc_port: int

    def deploy(
        self,
        config: dict[str, Any],
        name: str,
        route_prefix: str,
        api_keys: str | None = None,
    ) -> str:
        """Deploy a config as application ``name``; returns its OpenAI base URL. ``api_keys``
        (comma-separated): the config's ``api_keys`` reads them from an environment variable
        set only while it deploys (the keys are hashed then)."""
        from ray import serve

        from cluster.serving.serve import build_app

        config = {**config, "app_name": name}
        env = f"{name.upper().replace('-', '_')}_TEST_API_KEYS"
        if api_keys is not None:
            config["api_keys"] = {"env": env}
            os.environ[env] = api_keys
        try:
            serve.run(build_app(config), name=name, route_prefix=route_prefix)
        finally:
            os.environ.pop(env, None)
        prefix = "" if route_prefix == "/" else route_prefix
        return f"http://127.0.0.1:{self.http_port}{prefix}"


def start_local_ray(
    num_cpus: int, env: Mapping[str, str] | None = None, forward_env: bool = False
) -> None:
    """A fresh local Ray with ``num_cpus`` logical CPUs. ``env``: variables set only while Ray
    starts, so its worker processes inherit them and the test process does not; ``forward_env``:
    the runtime environment ``cluster serve`` gives its replicas (this project's settings and
    source tree)."""
    import ray

    from cluster.serving.serve import runtime_env

    with pytest.MonkeyPatch.context() as patch:
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        ray.init(
            address="local",  # a fresh instance even if another Ray cluster runs on this machine
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=(runtime_env() or None) if forward_env else None,
        )


@pytest.fixture(scope="module", autouse=True)
def local_ray(request: pytest.FixtureRequest) -> Iterator[None]:
    """A local Ray for each module marked ``pytest.mark.local_ray(num_cpus=…)`` (the marker's
    arguments are ``start_local_ray``'s), stopped after its last test; nothing for the others."""
    marker = request.node.get_closest_marker("local_ray")
    if marker is None:
        yield
        return
    import ray

    start_local_ray(*marker.args, **marker.kwargs)
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def simulated_nodes(
    head_cpus: int, node_cpus: Sequence[int] = (), runtime_env: dict[str, Any] | None = None
) -> Iterator[Any]:
    """A multi-node Ray on this machine (``ray.cluster_utils.Cluster``): a head node of
    ``head_cpus`` and one node per ``node_cpus`` entry, each a raylet with its own CPUs, this
    process its driver. Yields the ``Cluster`` (``add_node`` / ``remove_node`` for more); all of
    it is shut down after."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": head_cpus, "include_dashboard": False,
                        "dashboard_agent_listen_port": None},
    )  # fmt: skip
    try:
        for cpus in node_cpus:
            cluster.add_node(num_cpus=cpus)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, runtime_env=runtime_env or None)
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


@contextmanager
def simulated_serve_nodes(
    head_cpus: int, runtime_env: dict[str, Any], http_port: int, grpc_port: int | None = None
) -> Iterator[Any]:
    """``simulated_nodes`` of just the head, with Serve and its one proxy, on the head (the
    simulated nodes share this machine's ports): HTTP on ``http_port``, gRPC on ``grpc_port``
    when given. Yields the ``Cluster``; Serve and all of it are shut down after."""
    from ray import serve

    from cluster.ops.deploy import GRPC_SERVICER
    from cluster.ops.serve_proxies import serve_start, wait_for_proxies

    with simulated_nodes(head_cpus, runtime_env=runtime_env) as cluster:
        grpc_options = None
        if grpc_port is not None:
            grpc_options = {"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]}
        serve_start(http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options=grpc_options, proxy_location="HeadOnly")  # fmt: skip
        wait_for_proxies(http_port, grpc_port)
        try:
            yield cluster
        finally:
            serve.shutdown()


@pytest.fixture(scope="session")
def serve_cluster() -> Iterator[ServeCluster]:
    import ray
    from ray import serve

    from cluster.ops.deploy import GRPC_SERVICER
    from cluster.ops.serve_proxies import serve_start, wait_for_proxies
    from cluster.serving.serve import runtime_env

    ray.init(
        address="local",  # never join another cluster on this machine
        num_cpus=16,  # logical: each replica holds a front, a head and its workers
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=runtime_env() or None,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    cluster = ServeCluster(free_port(), free_port())
    serve_start(
        http_options={"host": "127.0.0.1", "port": cluster.http_port},
        grpc_options={"port": cluster.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
    )
    wait_for_proxies(cluster.http_port, cluster.grpc_port)
    try:
        yield cluster
    finally:
        serve.shutdown()
        ray.shutdown()
