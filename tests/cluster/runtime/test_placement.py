"""Placement across nodes without Ray running: which bundles hold workers, how ranks are dealt
to nodes so that each TP group shares one, and which node capacities are refused at once."""

from __future__ import annotations

import pytest

from cluster.runtime.placement import (
    PlacementError,
    assign_ranks_by_node,
    check_nodes_can_host,
    worker_slots,
)


def test_a_stage_bundle_holds_one_worker_per_device_and_front_and_head_come_first() -> None:
    specs = [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}]
    assert worker_slots(specs, "CPU")[-4:] == [2, 2, 3, 3]
    gpu_specs = [{"CPU": 1.0}, {"CPU": 1.0}, {"GPU": 4.0, "accelerator_type:H100": 0.001}]
    assert worker_slots(gpu_specs, "GPU") == [2, 2, 2, 2]


def test_ranks_are_dealt_node_by_node_so_interleaved_bundles_keep_tp_groups_together() -> None:
    # SPREAD may alternate nodes bundle by bundle: a, b, a, b.
    order = assign_ranks_by_node(["a", "b", "a", "b"], tensor_parallel_size=2)
    assert order == [0, 2, 1, 3]  # ranks 0-1 (stage 0) on a, ranks 2-3 (stage 1) on b


def test_bundles_that_would_split_a_tp_group_are_refused_naming_each_nodes_count() -> None:
    # The 3-CPU + 1-CPU case: PACK puts three worker bundles on the first node.
    with pytest.raises(PlacementError) as info:
        assign_ranks_by_node(["a", "a", "a", "b"], 2, {"a": "node A", "b": "node B"})
    message = str(info.value)
    assert "node A got 3 (not a multiple)" in message and "node B got 1 (not a multiple)" in message
    assert "tensor_parallel_size 2 needs a multiple of 2" in message


def test_nodes_of_3_and_1_cpus_cannot_host_two_tp_groups_of_2() -> None:
    with pytest.raises(PlacementError) as info:
        check_nodes_can_host({"node A": 3.0, "node B": 1.0}, 2, 2, "CPU")
    message = str(info.value)
    assert "room for 1 of the 2 TP groups" in message
    assert "node A has 3 CPU (1 TP group(s))" in message
    assert "node B has 1 CPU (1 short of one)" in message


def test_nodes_of_3_and_2_cpus_host_two_tp_groups_of_2() -> None:
    check_nodes_can_host({"node A": 3.0, "node B": 2.0}, 2, 2, "CPU")


def test_a_tp_group_larger_than_every_node_is_refused() -> None:
    with pytest.raises(PlacementError, match="no node has the 8 GPU one TP group needs"):
        check_nodes_can_host({"node A": 4.0, "node B": 4.0}, 8, 1, "GPU")


def test_strict_strategies_are_held_to_their_own_shape() -> None:
    capacities = {"node A": 2.0, "node B": 2.0}
    check_nodes_can_host(capacities, 2, 2, "CPU", "STRICT_SPREAD")
    with pytest.raises(PlacementError, match="room for 1 of the 2 TP groups on one node"):
        check_nodes_can_host(capacities, 2, 2, "CPU", "STRICT_PACK")
    with pytest.raises(PlacementError, match="on distinct nodes"):
        check_nodes_can_host({"node A": 4.0}, 2, 2, "CPU", "STRICT_SPREAD")
