"""``cluster.ops.deploy.deploy`` on a real local Ray when Serve's first proxy dies before it is
ready: ``serve.start`` raises, but Serve's controller starts another proxy, so the deploy goes
on, and the model answers on the config's port. On a busy 2-core machine the controller
itself kills a proxy that is not ready after three checks (CI, 2026-12-07); here the test kills
it, so that the path is taken on any machine."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import ray
from openai import OpenAI

from cluster.config import load_config
from cluster.ops import deploy
from tests.cluster.conftest import free_port, load_yaml

pytestmark = [pytest.mark.slow, pytest.mark.local_ray(num_cpus=4)]


def _kill_when_created(name: str, killed: list[str], timeout_s: float = 60.0) -> None:
    """Kill the actor ``name`` (Serve's namespace) as soon as it is registered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            actor = ray.get_actor(name, namespace="serve")
        except ValueError:
            time.sleep(0.005)
            continue
        ray.kill(actor)
        killed.append(name)
        return


def test_a_proxy_that_dies_while_serve_starts_is_replaced_and_the_model_serves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = load_yaml("tiny.yaml")
    raw["http_options"]["port"] = port = free_port()
    raw.pop("grpc_options")
    config = load_config(raw)
    proxy = f"SERVE_PROXY_ACTOR-{ray.get_runtime_context().get_node_id()}"
    killed: list[str] = []
    killer = threading.Thread(target=_kill_when_created, args=(proxy, killed))
    killer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="llm_cluster.deploy"):
            deploy.deploy(config, lambda line: None, 0.5)
        killer.join()
        assert killed == [proxy]
        assert "replaced a proxy that was slow to start" in caplog.text  # serve.start raised
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        reply = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=4)
        assert reply.usage.completion_tokens == 4
    finally:
        killer.join()
        deploy.shutdown()
