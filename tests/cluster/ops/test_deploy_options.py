"""``cluster.ops.deploy.start_serve`` on a cluster where Serve already runs: Serve keeps its HTTP
and gRPC options (``serve.start`` only logs that the new ones are ignored), so a config whose
options differ is refused with a ``DeployError`` naming each field, and the same options start
as before. Ray-free: Serve's controller is a fake answering ``get_http_config`` /
``get_grpc_config``, ``serve.start`` a recorder."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from ray.serve.config import HTTPOptions, gRPCOptions

from cluster.config import DeploymentConfig, load_config
from cluster.ops import deploy
from tests.cluster.conftest import CONFIGS


class _Call:
    def __init__(self, value: Any) -> None:
        self._value = value

    def remote(self) -> Any:
        return self._value


class FakeController:
    """Serve's controller as ``start_serve`` asks it: its HTTP and gRPC options."""

    def __init__(self, http: HTTPOptions, grpc: gRPCOptions) -> None:
        self.get_http_config = _Call(http)
        self.get_grpc_config = _Call(grpc)


def tiny_config(**http_options: Any) -> DeploymentConfig:
    """configs/tiny.yaml (HTTP 127.0.0.1:8000, gRPC 9000), ``http_options`` over its own;
    ``grpc_options=None`` drops gRPC."""
    data = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    grpc = http_options.pop("grpc_options", data["grpc_options"])
    data["http_options"].update(http_options)
    if grpc is None:
        del data["grpc_options"]
    else:
        data["grpc_options"] = grpc
    return load_config(data)


def serving(grpc_port: int | None = 9000, **http_options: Any) -> FakeController:
    """A running Serve as ``start_serve`` makes it for configs/tiny.yaml, ``http_options`` and
    ``grpc_port`` (None: no gRPC servicer) changed."""
    http = HTTPOptions(**{"host": "127.0.0.1", "port": 8000, **http_options})
    grpc = gRPCOptions()
    if grpc_port is not None:
        grpc = gRPCOptions(port=grpc_port, grpc_servicer_functions=[deploy.GRPC_SERVICER])
    return FakeController(http, grpc)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``serve.start``'s calls; Ray connected (its ``get`` answers the fake's values)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(deploy.serve, "start", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(deploy.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(deploy.ray, "get", lambda refs: list(refs))
    return calls


def run_serve_with(monkeypatch: pytest.MonkeyPatch, controller: FakeController | None) -> None:
    monkeypatch.setattr(deploy, "serve_controller", lambda: controller)


def test_a_running_serve_with_the_configs_options_is_started_as_before(
    monkeypatch: pytest.MonkeyPatch, started: list[dict[str, Any]]
) -> None:
    run_serve_with(monkeypatch, serving())
    deploy.start_serve(tiny_config())
    (kwargs,) = started
    assert kwargs["http_options"] == {"host": "127.0.0.1", "port": 8000}
    assert kwargs["grpc_options"]["port"] == 9000


def test_no_running_serve_starts_serve_with_the_configs_options(
    monkeypatch: pytest.MonkeyPatch, started: list[dict[str, Any]]
) -> None:
    run_serve_with(monkeypatch, None)
    deploy.start_serve(tiny_config(port=8080))
    (kwargs,) = started
    assert kwargs["http_options"]["port"] == 8080


def test_a_changed_http_port_is_refused_naming_the_field_and_both_values(
    monkeypatch: pytest.MonkeyPatch, started: list[dict[str, Any]]
) -> None:
    run_serve_with(monkeypatch, serving())
    with pytest.raises(deploy.DeployError) as info:
        deploy.start_serve(tiny_config(port=8080))
    assert list(info.value.reasons) == ["http_options.port"]
    reason = info.value.reasons["http_options.port"]
    assert "Serve already runs on this cluster with http_options.port 8000" in reason
    assert "the config has 8080" in reason
    assert "'cluster shutdown' first" in reason and "set http_options.port to 8000" in reason
    assert started == []


def test_a_changed_host_and_request_timeout_are_each_named(
    monkeypatch: pytest.MonkeyPatch, started: list[dict[str, Any]]
) -> None:
    run_serve_with(monkeypatch, serving(request_timeout_s=600.0))
    with pytest.raises(deploy.DeployError) as info:
        deploy.start_serve(tiny_config(host="0.0.0.0"))
    assert sorted(info.value.reasons) == ["http_options.host", "http_options.request_timeout_s"]
    timeout = info.value.reasons["http_options.request_timeout_s"]
    assert "request_timeout_s 600.0, the config has none" in timeout
    assert started == []


@pytest.mark.parametrize(
    ("running_grpc", "config_grpc", "running", "wanted"),
    [
        (9000, {"port": 9001}, "9000", "9001"),
        (9000, None, "9000", "no gRPC"),
        (None, {"port": 9000}, "no gRPC", "9000"),
    ],
)
def test_a_changed_grpc_port_is_refused(
    monkeypatch: pytest.MonkeyPatch,
    started: list[dict[str, Any]],
    running_grpc: int | None,
    config_grpc: dict[str, Any] | None,
    running: str,
    wanted: str,
) -> None:
    run_serve_with(monkeypatch, serving(grpc_port=running_grpc))
    with pytest.raises(deploy.DeployError) as info:
        deploy.start_serve(tiny_config(grpc_options=config_grpc))
    assert list(info.value.reasons) == ["grpc_options.port"]
    assert f"grpc_options.port {running}, the config has {wanted}" in str(info.value)
    assert started == []


def test_a_setting_serve_does_not_have_is_to_be_removed_to_keep_the_running_one(
    monkeypatch: pytest.MonkeyPatch, started: list[dict[str, Any]]
) -> None:
    run_serve_with(monkeypatch, serving(grpc_port=None))
    with pytest.raises(deploy.DeployError) as info:
        deploy.start_serve(tiny_config(request_timeout_s=600))
    reasons = info.value.reasons
    timeout = reasons["http_options.request_timeout_s"]
    assert "remove http_options.request_timeout_s from the config" in timeout
    assert "remove grpc_options from the config" in reasons["grpc_options.port"]
