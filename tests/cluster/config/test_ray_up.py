"""The ``ray up`` cluster-launcher configs: valid against the schema the ``ray`` package ships
(and through Ray's own preparation), a GPU-free head, GPU workers sized for the 70B config,
and setup commands that install torch pinned first, then this project, and no model."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")
ray_autoscaler = pytest.importorskip("ray.autoscaler", reason="ray is in the serve extra")

from cluster.config import load_config  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
LAUNCHER_CONFIGS = ["ray-cluster.aws.yaml", "ray-cluster.local.yaml"]
COMMAND_KEYS = [
    "initialization_commands",
    "setup_commands",
    "head_setup_commands",
    "worker_setup_commands",
    "head_start_ray_commands",
    "worker_start_ray_commands",
]
HEAD_FLAGS = [
    "--head",
    "--port=6379",
    "--num-gpus=0",
    "--dashboard-host=0.0.0.0",
    "--autoscaling-config=~/ray_bootstrap_config.yaml",
]


def launcher_config(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / name).read_text())


def ray_schema() -> dict[str, Any]:
    return json.loads((Path(ray_autoscaler.__file__).parent / "ray-schema.json").read_text())


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_config_validates_against_rays_cluster_schema(name: str) -> None:
    validator = jsonschema.Draft7Validator(ray_schema())
    errors = validator.iter_errors(launcher_config(name))
    assert [f"{list(e.absolute_path)}: {e.message}" for e in errors] == []


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_config_survives_rays_own_preparation(name: str) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(launcher_config(name)))
    validate_config(prepared)  # schema again, after defaults, plus Ray's cross-field checks
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_schema_check_rejects_an_unknown_key() -> None:
    config = launcher_config("ray-cluster.aws.yaml")
    config["available_node_types"]["gpu_h100x8"]["max_worker"] = 4
    config["min_worker"] = 1
    errors = list(jsonschema.Draft7Validator(ray_schema()).iter_errors(config))
    assert any("min_worker" in e.message for e in errors)


def test_aws_head_is_cpu_only_and_gpu_workers_are_8xh100_autoscaled() -> None:
    config = launcher_config("ray-cluster.aws.yaml")
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"]["GPU"] == 0
    assert head["max_workers"] == 0
    (gpu_name,) = [name for name in types if name != config["head_node_type"]]
    gpu = types[gpu_name]
    assert gpu["node_config"]["InstanceType"] == "p5.48xlarge"  # 8x H100
    assert gpu["resources"] == {"accelerator_type:H100": 1}
    assert 0 <= gpu["min_workers"] <= gpu["max_workers"] <= config["max_workers"]


def test_aws_gpu_workers_cover_the_70b_configs_replicas() -> None:
    model = load_config(CONFIGS / "llama70b.yaml").models[0]
    gpu = launcher_config("ray-cluster.aws.yaml")["available_node_types"]["gpu_h100x8"]
    assert model.world_size == 8  # TP 4 x PP 2: one replica per p5.48xlarge
    assert gpu["max_workers"] >= model.deployment_config.autoscaling_config.max_replicas
    assert f"accelerator_type:{model.accelerator_type}" in gpu["resources"]


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_head_starts_ray_without_gpus_with_dashboard_and_autoscaler(name: str) -> None:
    start = " ".join(launcher_config(name)["head_start_ray_commands"])
    assert [flag for flag in HEAD_FLAGS if flag not in start] == []


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_workers_join_the_head_gcs(name: str) -> None:
    start = " ".join(launcher_config(name)["worker_start_ray_commands"])
    assert "ray start --address=$RAY_HEAD_IP:6379" in start


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_setup_installs_pinned_torch_first_then_this_project(name: str) -> None:
    commands = launcher_config(name)["setup_commands"]
    assert re.fullmatch(r"pip install torch==\d+\.\d+\.\d+", commands[0])
    project = [i for i, c in enumerate(commands) if "llm-cluster[serve] @ " in c]
    assert len(project) == 1 and project[0] > 0


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_no_command_downloads_a_model(name: str) -> None:
    config = launcher_config(name)
    text = " ".join(c for key in COMMAND_KEYS for c in config.get(key, []))
    for word in ("huggingface-cli", "hf download", "snapshot_download", "s3 cp", "s3 sync"):
        assert word not in text
