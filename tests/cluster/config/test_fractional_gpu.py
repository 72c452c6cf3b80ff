"""Fractional GPU serving (Ray Serve LLM's ``placement_group_config.bundles``): which bundles a
deployment accepts, each refusal naming its field and the allowed range, the replica's placement
group laid out from them, and the Ray resources its head and worker actors then ask for."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from cluster.config import DeploymentConfig, ModelDeployment, load_config
from cluster.ops.capacity import replica_shortfall
from cluster.runtime.placement import PlacementError, worker_actor_resources, worker_slots
from cluster.serving.head_client import head_actor_resources
from engine.errors import ConfigError


def _model(
    bundles: list[dict[str, Any]] | None,
    accelerator: str | None = "L4",
    **engine: Any,
) -> dict[str, Any]:
    model: dict[str, Any] = {
        "model_loading_config": {"model_id": "m", "model_source": "example-org/elsewhere"},
        "engine_kwargs": {"max_model_len": 128, **engine},
        "placement_group_config": {"bundles": bundles} if bundles is not None else {},
    }
    if accelerator:
        model["accelerator_type"] = accelerator
    return model


def _load(bundles: list[dict[str, Any]] | None, **kw: Any) -> ModelDeployment:
    return load_config({"models": [_model(bundles, **kw)]}).models[0]


def _error(bundles: list[dict[str, Any]] | None, **kw: Any) -> str:
    with pytest.raises(ConfigError) as info:
        _load(bundles, **kw)
    return str(info.value)


PG = "models[0].placement_group_config.bundles"


# ---- accepted, and the bundles they give -------------------------------------------------------


def test_half_a_gpu_puts_the_share_in_the_head_bundle() -> None:
    model = _load([{"GPU": 0.49}], gpu_memory_utilization=0.4)
    bundles = model.serve_options()["placement_group_bundles"]
    # The front, then the head that runs the one worker: one CPU and 0.49 of one L4.
    assert bundles == [
        {"CPU": 1.0},
        {"CPU": 1.0, "GPU": 0.49, "accelerator_type:L4": 0.001},
    ]
    assert model.head_resources() == {"CPU": 1.0, "GPU": 0.49}
    assert head_actor_resources(model.head_resources()) == {"num_cpus": 1.0, "num_gpus": 0.49}


def test_bundle_cpus_go_to_the_head_that_runs_the_worker() -> None:
    model = _load([{"GPU": 0.33, "CPU": 2}], gpu_memory_utilization=0.3)
    assert model.placement_group_bundles()[1] == {
        "CPU": 2.0,
        "GPU": 0.33,
        "accelerator_type:L4": 0.001,
    }
    assert head_actor_resources(model.head_resources()) == {"num_cpus": 2.0, "num_gpus": 0.33}


def test_on_the_ray_backend_the_worker_actor_takes_the_fraction() -> None:
    model = _load([{"GPU": 0.49}], gpu_memory_utilization=0.45, distributed_executor_backend="ray")
    bundles = model.placement_group_bundles()
    assert bundles == [{"CPU": 1.0}, {"CPU": 1.0}, {"GPU": 0.49, "accelerator_type:L4": 0.001}]
    # The head only schedules; the executor finds one worker slot, the fractional bundle.
    assert head_actor_resources(model.head_resources()) == {"num_cpus": 1.0, "num_gpus": 0}
    assert worker_slots(bundles, "GPU") == [2]
    assert worker_actor_resources(bundles[2], "GPU") == {"num_gpus": 0.49, "num_cpus": 0.0}


def test_whole_gpus_per_worker_keep_the_default_layout() -> None:
    default = _load(None, tensor_parallel_size=2, pipeline_parallel_size=2)
    given = _load([{"GPU": 1}], tensor_parallel_size=2, pipeline_parallel_size=2)
    stage = {"GPU": 2.0, "accelerator_type:L4": 0.001}
    assert given.placement_group_bundles() == default.placement_group_bundles()
    assert default.placement_group_bundles() == [{"CPU": 1.0}, {"CPU": 1.0}, stage, stage]
    slots = worker_slots(given.placement_group_bundles(), "GPU")
    assert slots == [2, 2, 3, 3]
    assert worker_actor_resources(stage, "GPU") == {"num_gpus": 1.0, "num_cpus": 0.0}


def test_one_bundle_per_worker_sums_into_its_stage_bundle() -> None:
    per_worker = [{"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 3}, {"GPU": 1}, {"GPU": 1}]
    model = _load(per_worker, tensor_parallel_size=2, pipeline_parallel_size=2)
    bundles = model.placement_group_bundles()
    assert bundles[2:] == [
        {"GPU": 2.0, "CPU": 4.0, "accelerator_type:L4": 0.001},
        {"GPU": 2.0, "accelerator_type:L4": 0.001},
    ]
    # The stage's workers share its CPUs: each asks for one GPU and half of them.
    assert worker_actor_resources(bundles[2], "GPU") == {"num_gpus": 1.0, "num_cpus": 2.0}


def test_a_cpu_deployment_takes_a_fraction_of_a_cpu() -> None:
    model = _load([{"CPU": 0.5}], accelerator=None, device="cpu")
    assert model.placement_group_bundles() == [{"CPU": 1.0}, {"CPU": 0.5}]
    ray_backend = _load(
        [{"CPU": 0.5}], accelerator=None, device="cpu", distributed_executor_backend="ray"
    )
    bundles = ray_backend.placement_group_bundles()
    assert bundles == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 0.5}]
    # The front's and the head's CPUs count as slots too; the executor takes the last one.
    assert worker_slots(bundles, "CPU")[-1:] == [2]
    assert worker_actor_resources(bundles[2], "CPU") == {"num_cpus": 0.5}


def test_a_bundle_without_a_worker_share_is_no_worker_slot() -> None:
    with pytest.raises(PlacementError, match="holds no worker"):
        worker_actor_resources({"CPU": 1.0}, "GPU")


def test_three_third_gpu_models_each_fit_a_one_gpu_node() -> None:
    config = load_config({"models": [
        {**_model([{"GPU": 0.33}], gpu_memory_utilization=0.3),
         "model_loading_config": {"model_id": f"m{i}", "model_source": "example-org/elsewhere"}}
        for i in range(3)
    ]})  # fmt: skip
    assert isinstance(config, DeploymentConfig)
    node = {"node a": {"CPU": 8.0, "GPU": 1.0, "accelerator_type:L4": 1.0}}
    for model in config.models:
        assert replica_shortfall(model, node) is None
    # A third of a GPU is more than a node with a quarter of one holds.
    quarter = {"node a": {"CPU": 8.0, "GPU": 0.25, "accelerator_type:L4": 1.0}}
    why = replica_shortfall(config.models[0], quarter)
    assert why == (
        "no node has the 0.33 GPU the replica's worker needs (placement_group_config.bundles): "
        "node a has 0.25 GPU"
    )


# ---- refused, naming the field -----------------------------------------------------------------


def test_a_fraction_with_several_workers_is_refused_naming_nccl() -> None:
    message = _error([{"GPU": 0.5}], tensor_parallel_size=2, gpu_memory_utilization=0.4)
    assert message.startswith(f"{PG}[0].GPU: must be 1 with 2 workers")
    assert "NCCL cannot run two ranks of one group on one device" in message


def test_more_than_one_gpu_per_worker_is_refused_with_the_range() -> None:
    message = _error([{"GPU": 2}])
    assert message == f"{PG}[0].GPU: must be a number in (0, 1] (1, or a fraction < 1), got 2"


@pytest.mark.parametrize("share", [0, -0.5])
def test_a_share_of_nothing_is_refused(share: float) -> None:
    assert _error([{"GPU": share}]).startswith(f"{PG}[0].GPU: must be a number in (0, 1]")


def test_the_list_length_must_be_one_or_the_worker_count() -> None:
    message = _error([{"GPU": 1}] * 3, tensor_parallel_size=2)
    assert message.startswith(f"{PG}: must list 1 bundle (every worker's) or one per worker")
    assert "= 2), got 3" in message
    assert _error([], tensor_parallel_size=2).endswith("got 0")


def test_unknown_resources_are_refused_naming_the_allowed_ones() -> None:
    message = _error([{"GPU": 1, "TPU": 1}])
    assert message.startswith(f"{PG}[0].TPU: unknown resource (allowed: CPU, GPU;")
    assert _error([{"GPU": 1}], accelerator=None, device="cpu").startswith(
        f"{PG}[0].GPU: unknown resource (allowed: CPU;"
    )


def test_the_device_share_is_required() -> None:
    assert _error([{"CPU": 2}]) == f"{PG}[0].GPU: is required (the worker's device share)"


def test_negative_cpus_are_refused() -> None:
    message = _error([{"GPU": 1, "CPU": -1}])
    assert message.startswith(f"{PG}[0].CPU: must be a number >= 0")


def test_a_bundle_must_be_a_mapping() -> None:
    assert _error([0.5]).startswith(f"{PG}[0]: must be a mapping")  # type: ignore[list-item]


def test_a_gpu_share_needs_a_memory_utilization_within_it() -> None:
    key = "models[0].engine_kwargs.gpu_memory_utilization"
    unset = _error([{"GPU": 0.49}])
    assert unset.startswith(f"{key}: must be set to at most 0.49")
    assert unset.endswith("got None: each instance takes that fraction of its GPU's memory, "
                          "so the replicas Ray puts on one GPU must fit it together")  # fmt: skip
    assert _error([{"GPU": 0.33}], gpu_memory_utilization=0.4).startswith(
        f"{key}: must be set to at most 0.33"
    )
    _load([{"GPU": 0.5}], gpu_memory_utilization=0.5)  # equal is enough


def test_a_disaggregated_pool_is_checked_with_its_own_workers() -> None:
    model = _model([{"GPU": 1}])
    model["disaggregation"] = {
        "prefill": {"engine_kwargs": {"tensor_parallel_size": 2}},
        "decode": {"engine_kwargs": {}},
    }
    config = load_config({"models": [model]})
    assert len(config.models[0].pools()) == 2
    model["placement_group_config"] = {"bundles": [{"GPU": 0.5}]}
    model["engine_kwargs"]["gpu_memory_utilization"] = 0.4
    with pytest.raises(
        ConfigError, match="^" + re.escape(f"{PG}[0].GPU: must be 1 with 2 workers")
    ):
        load_config({"models": [model]})


def test_the_shipped_shared_gpu_config_puts_three_heads_on_a_third_each() -> None:
    config = load_config(Path(__file__).resolve().parents[3] / "configs" / "shared-gpu.yaml")
    assert len(config.models) == 3
    for model in config.models:
        assert model.head_resources() == {"CPU": 1.0, "GPU": 0.33}
        assert model.engine_kwargs["gpu_memory_utilization"] <= 0.33
    node = {"one H100": {"CPU": 16.0, "GPU": 1.0, "accelerator_type:H100": 1.0}}
    needed = sum(m.placement_group_bundles()[1]["GPU"] for m in config.models)
    assert needed <= node["one H100"]["GPU"]
    assert all(replica_shortfall(m, node) is None for m in config.models)


# ---- models that take turns (sleep_mode) on GPU shares ------------------------------------------


def _turns(max_awake: int | None, utilization: float, replicas: int = 1) -> dict[str, Any]:
    models = []
    for name in ("a", "b", "c"):
        model = _model([{"GPU": 0.33}], gpu_memory_utilization=utilization)
        model["model_loading_config"]["model_id"] = name
        model["deployment_config"] = {"num_replicas": replicas}
        model["sleep_config"] = {"level": 1}
        models.append(model)
    config: dict[str, Any] = {"models": models}
    if max_awake is not None:
        config["sleep_mode"] = {"max_awake_models": max_awake}
    return config


def test_models_that_take_turns_may_ask_for_more_than_their_share() -> None:
    config = load_config(_turns(2, 0.45))
    assert [config.starts_asleep(m.model_id) for m in config.models] == [False, False, True]
    shipped = load_config(Path(__file__).resolve().parents[3] / "configs" / "gpu-take-turns.yaml")
    assert shipped.awake_spec() is not None and shipped.starts_asleep(shipped.models[2].model_id)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # Three awake at once could land on one GPU: 1.35 of its memory.
        (_turns(3, 0.45), "0.45 (a) + 0.45 (b) + 0.45 (c)"),
        # Two replicas of each of two awake models: 4 x 0.3.
        (_turns(2, 0.3, replicas=2), "0.6 (b) + 0.6 (c)"),
    ],
)
def test_the_awake_ones_must_fit_one_gpu_together(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value).startswith("sleep_mode.max_awake_models:") and message in str(info.value)


def test_without_sleep_mode_each_model_keeps_within_its_share() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_turns(None, 0.45))
    assert "models[0].engine_kwargs.gpu_memory_utilization" in str(info.value)
