"""TP x PP workers on a Ray cluster of several nodes, simulated on this machine
(``ray.cluster_utils.Cluster``: a head offering no CPU, and worker nodes with their own CPUs).

Each TP group lands on one node, pipeline stages on different ones when no node has room for
both, and the output is token-equal to TP = PP = 1; a shape the nodes can never host is refused
at once, naming every node's CPUs, instead of waiting for placement.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from cluster.runtime.ray_executor import PlacementError
from engine import LLM, SamplingParams
from tests.cluster.conftest import simulated_nodes
from tests.cluster.runtime.compiled_dispatch import forced

ENGINE_ARGS: dict[str, Any] = {
    "num_kv_blocks": 64,
    "max_num_batched_tokens": 16,
    "enable_chunked_prefill": True,
    "max_model_len": 128,
    "device": "cpu",
    "dtype": "float32",
}
PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog and", "Paris is the capital of"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


class Nodes:
    """The simulated cluster; ``reshape`` replaces its worker nodes (the head, which the
    driver is connected to, stays and offers no CPU)."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.cpus: list[int] = []

    def reshape(self, cpus: list[int]) -> None:
        if sorted(cpus) == sorted(self.cpus):
            return
        for node in list(self.cluster.worker_nodes):
            self.cluster.remove_node(node)
        for n in cpus:
            self.cluster.add_node(num_cpus=n)
        self.cpus = list(cpus)
        deadline = time.monotonic() + 30
        while sorted(_alive_worker_cpus()) != sorted(cpus):
            if time.monotonic() > deadline:
                raise AssertionError(f"nodes {_alive_worker_cpus()} never became {cpus}")
            time.sleep(0.2)


def _alive_worker_cpus() -> list[int]:
    return [
        int(node["Resources"].get("CPU", 0))
        for node in ray.nodes()
        if node["Alive"] and node["Resources"].get("CPU", 0) > 0
    ]


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    with simulated_nodes(0) as cluster:
        yield Nodes(cluster)


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.slow  # ~30 s: a 3-node Ray, four worker actors, the reference engine
@pytest.mark.slow  # ~15-25 s: a 3-node Ray, four worker actors, the reference engine
def test_tp2_pp2_over_two_2_cpu_nodes_keeps_each_tp_group_on_one_node(nodes: Nodes) -> None:
    nodes.reshape([2, 2])
    reference = LLM("builtin:tiny-llama", distributed_executor_backend="uni", **ENGINE_ARGS)
    expected = _greedy(reference)
    reference.llm_engine.shutdown()
    llm = LLM("builtin:tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE_ARGS)
    try:
        workers = llm.llm_engine.executor.workers
        node_of_rank = ray.get([w.node_id.remote() for w in workers])
        # ranks = pp_rank * TP + tp_rank: ranks 0-1 are stage 0's TP group, 2-3 stage 1's.
        assert node_of_rank[0] == node_of_rank[1]
        assert node_of_rank[2] == node_of_rank[3]
        assert node_of_rank[0] != node_of_rank[2]  # no node has room for both groups
        # Across nodes through the Ray Compiled Graph (GPU workers'; CPU workers use actor calls).
        with forced("compiled"):
            assert _greedy(llm) == expected
        assert llm.llm_engine.executor.dispatch_mode == "compiled"
    finally:
        llm.llm_engine.shutdown()


def test_a_tp_group_larger_than_every_node_is_refused_at_once(nodes: Nodes) -> None:
    nodes.reshape([2, 2])
    start = time.monotonic()
    with pytest.raises(PlacementError) as info:
        LLM("builtin:tiny-llama", tensor_parallel_size=4, **ENGINE_ARGS)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "no node has the 4 CPU one TP group needs" in message
    assert message.count("has 2 CPU (2 short of one)") == 2  # each worker node named


def test_nodes_of_3_and_1_cpus_refuse_tp2_pp2_at_once_naming_each_node(nodes: Nodes) -> None:
    # Four CPUs in all, but a TP group of 2 fits only on the 3-CPU node: running would split
    # the second stage's group across nodes, so nothing runs.
    nodes.reshape([3, 1])
    start = time.monotonic()
    with pytest.raises(PlacementError) as info:
        LLM("builtin:tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE_ARGS)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "room for 1 of the 2 TP groups" in message
    assert "has 3 CPU (1 TP group(s))" in message and "has 1 CPU (1 short of one)" in message
    # Refused before a placement group was asked for: none is left pending.
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow


def test_more_dp_ranks_than_the_nodes_can_place_are_refused_at_once(nodes: Nodes) -> None:
    # Four CPUs for four workers, but only the 3-CPU node holds a TP group of 2: the second DP
    # rank's group would span nodes, so nothing runs.
    nodes.reshape([3, 1])
    start = time.monotonic()
    with pytest.raises(PlacementError) as info:
        LLM(
            "builtin:tiny-qwen3-moe", tensor_parallel_size=2, data_parallel_size=2,
            enable_expert_parallel=True, **ENGINE_ARGS,
        )  # fmt: skip
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "x data_parallel_size 2 needs 2 TP group(s) of 2 CPU" in message
    assert "room for 1 of the 2 TP groups" in message
