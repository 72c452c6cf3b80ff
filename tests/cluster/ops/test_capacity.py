"""``cluster.ops.capacity``: ``cluster deploy`` names at once, per node, why the cluster's nodes
(and its autoscaler's node types) cannot hold a model's replica, and reports nothing for
what fits.

The last test deploys onto a simulated Ray cluster (``ray.cluster_utils.Cluster``) through
``cluster.ops.deploy.deploy`` itself: the shortfall is reported within seconds, and cleared when a
node with room joins while the deployment waits.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from ray.core.generated import autoscaler_pb2

from cluster.config import DeploymentConfig, load_config
from cluster.ops.capacity import autoscaling_nodes, placement_shortfalls, replica_shortfall


def _config(
    accelerator: str | None = None, strategy: str = "PACK", **engine: Any
) -> DeploymentConfig:
    model: dict[str, Any] = {
        "model_loading_config": {
            "model_id": "m",
            "model_source": "example-org/not-on-this-machine",
        },
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
    message = placement_shortfalls(config, nodes)["m"]
    assert "tensor_parallel_size 8" in message
    for name in ("node a has 4 GPU", "node b has 4 GPU", "node c has 4 GPU"):
        assert name in message


def test_stages_on_separate_nodes_fit() -> None:
    config = _config("H100", tensor_parallel_size=4, pipeline_parallel_size=2)
    assert placement_shortfalls(config, {"node a": _gpu_node(4), "node b": _gpu_node(4)}) == {}


def test_data_parallel_ranks_are_one_tp_group_each_in_the_replicas_bundles() -> None:
    config = _config(
        "H100", tensor_parallel_size=4, data_parallel_size=2, enable_expert_parallel=True
    )
    model = config.models[0]
    assert model.world_size == 8
    assert model.placement_group_bundles()[2:] == [{"GPU": 4.0, "accelerator_type:H100": 0.001}] * 2
    assert replica_shortfall(model, {"node a": _gpu_node(4), "node b": _gpu_node(4)}) is None
    why = replica_shortfall(model, {"node a": _gpu_node(6), "node b": _gpu_node(2)})
    assert why is not None and "x data_parallel_size 2 needs 2 TP group(s) of 4 GPU" in why


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


def test_each_pool_of_a_disaggregated_model_is_checked_with_its_own_tp() -> None:
    """The prefill pool's TP 8 (its engine_kwargs over the model's TP 4) fits no 4-GPU node;
    the decode pool, at the model's TP 4, does."""
    data: dict[str, Any] = {
        "models": [
            {
                "model_loading_config": {
                    "model_id": "m",
                    "model_source": "example-org/not-on-this-machine",
                },
                "engine_kwargs": {"max_model_len": 128, "tensor_parallel_size": 4},
                "accelerator_type": "H100",
                "disaggregation": {"prefill": {"engine_kwargs": {"tensor_parallel_size": 8}}},
            }
        ]
    }
    nodes = {"node a": _gpu_node(4), "node b": _gpu_node(4)}
    shortfalls = placement_shortfalls(load_config(data), nodes)
    assert list(shortfalls) == ["m (prefill)"]
    assert "tensor_parallel_size 8" in shortfalls["m (prefill)"]


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
def test_deploy_names_the_shortfall_at_once_and_clears_it_when_a_node_joins() -> None:
    import contextlib
    import threading

    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from cluster.ops import deploy

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
    )
    lines: list[str] = []
    # TP 2 x PP 2 on CPU: 2 stages of 2 CPUs; the nodes hold one such TP group.
    config = _config(device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2)
    thread: threading.Thread | None = None
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        started = time.monotonic()

        def run() -> None:
            # Ends with an error once the test removes Serve (the model is not on this machine
            # either): only the progress lines are checked.
            with contextlib.suppress(Exception):
                deploy.deploy(config, progress=lines.append, poll_s=0.5)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        _wait_for(lambda: any("cannot place a replica" in line for line in lines), 60)
        assert time.monotonic() - started < 60
        [line] = [line for line in lines if "cannot place" in line]
        assert "room for 1 of the 2 TP groups" in line
        assert "has 2 CPU (1 TP group(s))" in line and "has 1 CPU (1 short of one)" in line
        cluster.add_node(num_cpus=3)  # a second TP group, and 6 CPUs for the whole replica
        _wait_for(lambda: any("can now hold a replica" in line for line in lines), 60)
    finally:
        # Remove the app first and let deploy's loop end on it: a Serve call from that thread
        # after ray.shutdown() would connect the driver again and block the cluster's shutdown.
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                serve.delete(config.app_name)
            if thread is not None:
                thread.join(60)
            serve.shutdown()
            ray.shutdown()
        cluster.shutdown()


def _wait_for(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
