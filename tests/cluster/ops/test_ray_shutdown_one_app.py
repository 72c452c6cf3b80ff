"""``cluster.ops.deploy.shutdown(app_name)`` on a real local Ray and Serve: what ``cluster serve
--address`` runs when it stops on a cluster others deploy to. It removes its own application
only, leaves Serve up while another application is there, and stops Serve with the last one;
without a name (its own local Ray, ``cluster shutdown``) it removes every application."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ray import serve

from cluster.ops import deploy
from cluster.ops.serve_proxies import serve_controller, serve_start
from tests.cluster.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.local_ray(num_cpus=2)]


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class _Echo:
    def __call__(self) -> str:
        return "ok"


def _run(name: str) -> None:
    serve.run(_Echo.bind(), name=name, route_prefix=f"/{name}")


@pytest.fixture
def two_apps() -> Iterator[None]:
    serve_start(http_options={"host": "127.0.0.1", "port": free_port()})
    _run("mine")
    _run("theirs")
    yield
    deploy.shutdown()


def test_a_named_shutdown_removes_that_application_only_and_keeps_serve(two_apps: None) -> None:
    deploy.shutdown("mine")
    assert list(serve.status().applications) == ["theirs"]
    assert serve_controller() is not None
    deploy.shutdown("theirs")  # the last one: Serve stops with it
    assert serve_controller() is None


def test_an_unnamed_shutdown_removes_every_application(two_apps: None) -> None:
    deploy.shutdown()
    assert serve_controller() is None
