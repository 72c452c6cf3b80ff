"""The ``cluster`` command as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_make_model_writes_an_hf_directory(tmp_path) -> None:
    result = _cluster("make-model", "tiny-qwen2", str(tmp_path / "q"))
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (tmp_path / "q" / "tokenizer.json").exists()


@pytest.mark.slow
def test_generate_prints_a_completion() -> None:
    result = _cluster(
        "generate", "Hello there", "--max-tokens", "5", "--engine-arg", "num_kv_blocks=64"
    )
    assert result.returncode == 0, result.stderr
    assert "completion:" in result.stdout and "finish_reason=length" in result.stdout


def test_generate_with_bad_engine_argument_exits_2_naming_it() -> None:
    result = _cluster("generate", "x", "--engine-arg", "block_sise=16")
    assert result.returncode == 2
    assert "block_sise: unknown engine argument" in result.stderr


def test_direct_ingress_pins_serves_ports_to_the_config_and_moves_the_proxies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cluster.config import load_config
    from cluster.ops import deploy

    # Every variable it sets is undone after the test (the serving tests' Ray must not see them).
    ends = ("MIN_HTTP_PORT", "MAX_HTTP_PORT", "MIN_GRPC_PORT", "MAX_GRPC_PORT",
            "MIN_DRAINING_PERIOD_S")  # fmt: skip
    names = [n for n in os.environ if n.startswith("RAY_SERVE_")]
    names += [f"RAY_SERVE_DIRECT_INGRESS_{end}" for end in ends]
    for name in [*names, "RAY_SERVE_THROUGHPUT_OPTIMIZED"]:
        monkeypatch.setenv(name, "")  # recorded, so undone after the test (even if unset now)
        monkeypatch.delenv(name)
    config = load_config(ROOT / "configs" / "tiny.yaml")
    deployed = deploy.direct_ingress(config)
    assert deployed is not None
    assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    http, grpc = config.http_options.port, config.grpc_options.port
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == str(http)
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == str(http + 1)
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"] == str(grpc)
    # The proxies go elsewhere, so they never hold the ports the ingress must bind.
    assert deployed.http_options.port not in (http, grpc)
    assert deployed.grpc_options.port not in (http, grpc, deployed.http_options.port)
    assert deployed.models == config.models

    # Either switch at 0 in the environment is the operator's "no": Serve's proxy, as given.
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "0")
    assert deploy.direct_ingress(config) is None
