"""``cluster.ops.deploy.deploy()`` on a real local Ray refuses a deployment that cannot fit its GPUs
before anything starts: no Serve controller, no proxy, no replica, no placement group."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from cluster.config import load_config
from cluster.ops import deploy
from cluster.ops.plan import PlanError
from tests.cluster.ops.test_plan import MODEL_ID, llama70b_yaml


@pytest.mark.slow  # ~15 s: most of it starting and stopping the local Ray
def test_deploy_refuses_llama70b_on_one_h100_before_any_actor_starts(tmp_path: Path) -> None:
    config = load_config(llama70b_yaml(tmp_path, tensor_parallel_size=1, pipeline_parallel_size=1))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        lines: list[str] = []
        start = time.monotonic()
        with pytest.raises(PlanError) as info:
            deploy.deploy(config, progress=lines.append)
        assert time.monotonic() - start < 10
        assert list(info.value.problems) == [MODEL_ID]
        assert "weights 131.42 GiB" in str(info.value) and "usable 71.27 GiB" in str(info.value)
        assert lines == []
        # Serve's controller and proxies are named actors, as is every replica: none exists.
        assert ray.util.list_named_actors(all_namespaces=True) == []
        assert ray.util.placement_group_table() == {}
        assert ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU")
    finally:
        ray.shutdown()


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow
