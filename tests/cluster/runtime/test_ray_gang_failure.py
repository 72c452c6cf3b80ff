"""A data-parallel gang losing one rank's worker mid-generation, deployed by ``cluster deploy``
(``cluster.ops.deploy.deploy``) on a multi-node Ray simulated on this machine
(``ray.cluster_utils.Cluster``). Named ``test_ray_*``: it starts its own Ray, so it runs before
the serving modules start the session's (conftest).

    head node  2 CPUs   GCS, Serve's controller, its HTTP and gRPC proxy (HeadOnly), the ingress
    node A     3 CPUs   } GANG (DP 2 x TP 2, EP 4: 6 CPUs in four bundles, its front, its head
    node B     3 CPUs   }   and one TP group of 2 per DP rank) and STEADY (front + head): 8 in all

No node holds two TP groups (2 CPUs each), so the DP ranks sit on different nodes whatever
Ray's choice; and the cluster has exactly the CPUs of both replicas, so the replacement gang
can be placed only once the old placement group is gone.

Asserted (``run_fault``, shared with ``tests/cluster/serving/test_serve_faults.py``): every
in-flight request of GANG, on both cores — plain, streamed, gRPC — ends with an error naming
the model within 30 s, ``/health`` names it, Serve replaces the replica and a fresh request
succeeds within 120 s, STEADY serves throughout; and the gang is replaced as one: all four
workers new, one new placement group spanning both nodes, the old one removed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from cluster.proto import llm_pb2_grpc
from tests.cluster.conftest import (
    free_port,
    health_checked_model,
    load_yaml,
    simulated_serve_nodes,
)
from tests.cluster.serving.test_serve_faults import STEADY, kill, named_actors, run_fault

pytestmark = pytest.mark.slow

APP = "gang"
GANG = "tiny-moe-dp2-tp2"


def deployment_config(http_port: int, grpc_port: int) -> Any:
    from cluster.config import load_config

    config = load_yaml("tiny.yaml")
    gang = health_checked_model(GANG, data_parallel_size=2, tensor_parallel_size=2,
                                enable_expert_parallel=True)  # fmt: skip
    gang["model_loading_config"]["model_source"] = "builtin:tiny-qwen3-moe"
    config["models"] = [gang, health_checked_model(STEADY)]
    config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    config["grpc_options"] = {"port": grpc_port}
    config["app_name"] = APP
    return load_config(config)


@dataclass
class Deployed:
    url: str
    stub: llm_pb2_grpc.LLMStub
    nodes: dict[str, str]  # "head", "A", "B" -> Ray node id


@pytest.fixture(scope="module")
def deployed() -> Iterator[Deployed]:
    from cluster.ops.deploy import deploy
    from cluster.serving.serve import runtime_env

    http_port, grpc_port = free_port(), free_port()
    with simulated_serve_nodes(2, runtime_env(), http_port, grpc_port) as cluster:
        node_a = cluster.add_node(num_cpus=3)
        node_b = cluster.add_node(num_cpus=3)
        deploy(deployment_config(http_port, grpc_port), print)
        ids = {"head": cluster.head_node.node_id, "A": node_a.node_id, "B": node_b.node_id}
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            yield Deployed(f"http://127.0.0.1:{http_port}", llm_pb2_grpc.LLMStub(channel), ids)


def gang_placement_groups() -> dict[str, list[str]]:
    """The live placement groups of GANG's replicas (four bundles; STEADY's has two): id -> the
    node of each bundle, in bundle order."""
    import ray

    groups = {}
    for pg_id, pg in ray.util.placement_group_table().items():
        if pg["state"] == "CREATED" and len(pg["bundles"]) == 4:
            nodes = pg["bundles_to_node_id"]
            groups[pg_id] = [nodes[i] for i in sorted(nodes)]
    return groups


def test_a_data_parallel_rank_killed_on_one_node_replaces_the_whole_gang(
    deployed: Deployed,
) -> None:
    from cluster.runtime.ray_executor import WORKER_NAME_PREFIX

    groups_before = gang_placement_groups()
    assert len(groups_before) == 1, groups_before
    (bundle_nodes,) = groups_before.values()
    # Bundles: front, head, DP rank 0's TP group, DP rank 1's: the ranks on distinct nodes.
    assert bundle_nodes[2] != bundle_nodes[3], bundle_nodes
    assert {bundle_nodes[2], bundle_nodes[3]} == {deployed.nodes["A"], deployed.nodes["B"]}
    prefix = f"{WORKER_NAME_PREFIX}{GANG}:"
    workers = named_actors(prefix)
    assert [name.rsplit(":", 1)[1] for name, _ in workers] == [f"rank{r}" for r in range(4)]

    # Ranks are DP-major: rank 3 is DP rank 1's second TP rank.
    run_fault(deployed.url, deployed.stub, lambda: kill(workers[3]), model=GANG, app=APP)

    replacement = named_actors(prefix)
    assert len(replacement) == 4 and not set(replacement) & set(workers), replacement
    groups_after = gang_placement_groups()
    assert len(groups_after) == 1 and not groups_after.keys() & groups_before.keys()
    (bundle_nodes,) = groups_after.values()
    assert {bundle_nodes[2], bundle_nodes[3]} == {deployed.nodes["A"], deployed.nodes["B"]}
