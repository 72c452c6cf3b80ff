"""``cluster.capacity``: ``cluster deploy`` refuses at once a replica that the cluster's nodes
(and its autoscaler's node types) can never hold, naming each node's capacity, and lets
through everything that could fit.

The last test deploys onto a simulated two-node Ray cluster (``ray.cluster_utils.Cluster``)
through ``cluster.deploy.deploy`` itself: it fails before Serve starts.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from ray.core.generated import autoscaler_pb2

from cluster.capacity import (
    autoscaling_nodes,
    check_deployment_placeable,
    replica_shortfall,
)
from cluster.config import DeploymentConfig, load_config
from cluster.ray_executor import PlacementError


def _config(
    accelerator: str | None = None, strategy: str = "PACK", **engine: Any
) -> DeploymentConfig:
    model: dict[str, Any] = {
        "model_loading_config": {"model_id": "m", "model_source": "example-org/not-on-this-machine"},
        "engine_kwargs": {"max_model_len": 128, **engine},
        "placement_group_config": {"strategy": strategy},
    }
    if accelerator:
        model["accelerator_type"] = accelerator
    return load_config({"models": [model]})


def _gpu_node(gpus: int, accelerator: str = "H100", cpus: int = 32) -> dict[str, float]:
    return {"CPU": float(cpus), "GPU": float(gpus), f"accelerator_type:{accelerator}": 1.0}


def test_tp_group_larger_than_every_node_is_refused_naming_each_node() -> None:
    config = _config("H100", tensor_parallel_size=8, pipeline_parallel_size=2)
    nodes = {"node a": _gpu_node(4), "node b": _gpu_node(4), "node c": _gpu_node(4)}
    with pytest.raises(PlacementError) as err:
        check_deployment_placeable(config, nodes)
    message = str(err.value)
    assert "model 'm'" in message and "tensor_parallel_size 8" in message
    for name in ("node a has 4 GPU", "node b has 4 GPU", "node c has 4 GPU"):
        assert name in message


def test_stages_on_separate_nodes_fit() -> None:
    config = _config("H100", tensor_parallel_size=4, pipeline_parallel_size=2)
    check_deployment_placeable(config, {"node a": _gpu_node(4), "node b": _gpu_node(4)})


def test_too_few_nodes_for_the_stages_is_refused() -> None:
    config = _config("H100", tensor_parallel_size=4, pipeline_parallel_size=2)
    why = replica_shortfall(config.models[0], {"node a": _gpu_node(6), "node b": _gpu_node(2)})
    assert why is not None and "room for 1 of the 2 TP groups" in why


def test_only_nodes_of_the_accelerator_type_count() -> None:
    config = _config("H100", tensor_parallel_size=4)
    nodes = {"node a": _gpu_node(8, "A10G")}
    why = replica_shortfall(config.models[0], nodes)
    assert why is not None and "accelerator_type 'H100'" in why and "node a" in why
    assert replica_shortfall(config.models[0], {**nodes, "node b": _gpu_node(4)}) is None


def test_strict_pack_needs_every_stage_on_one_node() -> None:
    config = _config("H100", "STRICT_PACK", tensor_parallel_size=4, pipeline_parallel_size=2)
    two = {"node a": _gpu_node(4), "node b": _gpu_node(4)}
    assert "STRICT_PACK" in (replica_shortfall(config.models[0], two) or "")
    assert replica_shortfall(config.models[0], {"node a": _gpu_node(8)}) is None


def test_cpu_bundles_in_all_must_fit_the_cpus() -> None:
    # CPU workers: front 1 + head 1 + 2 stages x TP 2 = 6 CPUs; TP groups fit, the total not.
    config = _config(device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2)
    why = replica_shortfall(config.models[0], {"node a": {"CPU": 2.0}, "node b": {"CPU": 3.0}})
    assert why is not None and "needs 6 CPU in all" in why and "(1 short)" in why
    assert replica_shortfall(config.models[0], {"a": {"CPU": 2.0}, "b": {"CPU": 4.0}}) is None


def test_node_types_an_autoscaler_may_add_count() -> None:
    cluster_config = autoscaler_pb2.ClusterConfig()
    group = cluster_config.node_group_configs.add()
    group.name = "gpu-h100x8"
    group.max_count = 2
    for key, value in _gpu_node(8).items():
        group.resources[key] = int(value)
    unbounded = cluster_config.node_group_configs.add()
    unbounded.name = "cpu"
    unbounded.max_count = -1
    unbounded.resources["CPU"] = 16
    added = autoscaling_nodes(cluster_config, limit=3)
    assert len([n for n in added if "gpu-h100x8" in n]) == 2
    assert len([n for n in added if "'cpu'" in n]) == 3
    config = _config("H100", tensor_parallel_size=8, pipeline_parallel_size=2)
    head_only = {"head": {"CPU": 8.0}}
    assert replica_shortfall(config.models[0], head_only) is not None
    assert replica_shortfall(config.models[0], {**head_only, **added}) is None
    assert autoscaling_nodes(None) == {}


@pytest.mark.slow
def test_deploy_to_a_cluster_too_small_fails_before_serve_starts() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from cluster import deploy

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address)
        deadline = time.monotonic() + 30
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert time.monotonic() < deadline, "the second node never came up"
            time.sleep(0.2)
        config = _config(device="cpu", tensor_parallel_size=2)
        started = time.monotonic()
        with pytest.raises(PlacementError) as err:
            deploy.deploy(config, progress=lambda line: None)
        assert time.monotonic() - started < 10
        message = str(err.value)
        assert "no node has the 2 CPU one TP group needs" in message
        assert message.count("has 1 CPU") == 2
        from ray import serve

        with pytest.raises(Exception):  # noqa: B017 (Serve was never started)
            serve.context._get_global_client()
    finally:
        ray.shutdown()
        cluster.shutdown()
