"""Placement arithmetic for TP x PP workers across Ray nodes, with no Ray call and no torch:
which bundle slot each rank takes (every TP group on one node), and whether a set of nodes can
ever hold one TP group per pipeline stage. Used by ``cluster.runtime.ray_executor`` once a placement
group is placed or before it asks for one, and by ``cluster.ops.capacity`` before a deployment.
"""

from __future__ import annotations

from collections.abc import Sequence


class PlacementError(RuntimeError):
    """The workers cannot be placed with each TP group on one node, or not at all."""


def _slots_in(spec: dict[str, float], resource: str) -> int:
    amount = spec.get(resource, 0)
    return 1 if 0 < amount < 1 else int(amount)


def worker_slots(bundle_specs: Sequence[dict[str, float]], resource: str) -> list[int]:
    """One entry per worker a bundle can hold (one per unit of ``resource``, or one for a
    fraction of a unit: a one-worker replica that shares its device), in bundle order:
    ``[{"CPU": 1}, {"CPU": 2}]`` gives ``[0, 1, 1]``, ``[{"CPU": 1}, {"GPU": 0.49}]`` with
    ``"GPU"`` gives ``[1]``."""
    return [i for i, spec in enumerate(bundle_specs) for _ in range(_slots_in(spec, resource))]


def worker_actor_resources(spec: dict[str, float], resource: str) -> dict[str, float]:
    """What a worker actor in a bundle of ``spec`` asks Ray for: its share of the bundle's
    devices (one, or the bundle's fraction) and, on GPU, of the bundle's CPUs (none unless the
    bundle reserves some). ``resource``: ``"GPU"`` or ``"CPU"``."""
    slots = _slots_in(spec, resource)
    if slots < 1:
        raise PlacementError(f"placement: bundle {spec} holds no worker ({resource} share 0)")
    share = min(float(spec[resource]), 1.0)
    if resource == "CPU":
        return {"num_cpus": share}
    return {"num_gpus": share, "num_cpus": float(spec.get("CPU", 0.0)) / slots}


def assign_ranks_by_node(
    slot_nodes: Sequence[str], tensor_parallel_size: int, names: dict[str, str] | None = None
) -> list[int]:
    """The slot of each rank, given each slot's node: nodes in order of their first slot,
    each node's slots in order, so every run of ``tensor_parallel_size`` ranks (a TP group)
    is on one node. Raises ``PlacementError`` naming every node's count when some node holds
    a number of slots that is not a multiple of ``tensor_parallel_size``."""
    by_node: dict[str, list[int]] = {}
    for slot, node in enumerate(slot_nodes):
        by_node.setdefault(node, []).append(slot)
    tp = tensor_parallel_size
    if any(len(slots) % tp for slots in by_node.values()):
        names = names or {}
        counts = "; ".join(
            f"{names.get(node, node)} got {len(slots)}"
            + (" (not a multiple)" if len(slots) % tp else "")
            for node, slots in by_node.items()
        )
        raise PlacementError(
            f"placement: the placement group's {len(slot_nodes)} worker bundles would split a "
            f"TP group across nodes: {counts}; tensor_parallel_size {tp} needs a multiple of "
            f"{tp} worker bundles on each node (whole TP groups). Give the placement group one "
            f"bundle of {tp} devices per pipeline stage, or a STRICT_PACK strategy"
        )
    return [slot for slots in by_node.values() for slot in slots]


def check_nodes_can_host(
    capacities: dict[str, float],
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    resource: str,
    strategy: str = "PACK",
    data_parallel_size: int = 1,
) -> None:
    """Raise ``PlacementError`` naming each node's capacity when the nodes (name -> units of
    ``resource``) can never hold one TP group per pipeline stage (and data-parallel rank), each
    group on one node: STRICT_PACK wants them all on one node, STRICT_SPREAD each on its own."""
    tp, pp, dp = tensor_parallel_size, pipeline_parallel_size, data_parallel_size
    needed = pp * dp
    groups = [int(amount // tp) for amount in capacities.values()]
    if strategy == "STRICT_PACK":
        room, unit = max(groups, default=0), "on one node (STRICT_PACK)"
    elif strategy == "STRICT_SPREAD":
        room, unit = sum(1 for g in groups if g), "on distinct nodes (STRICT_SPREAD)"
    else:
        room, unit = sum(groups), "in all"
    if room >= needed:
        return
    what = (
        f"no node has the {tp} {resource} one TP group needs"
        if not any(groups)
        else f"the nodes have room for {room} of the {needed} TP groups {unit}"
    )
    shape = f"tensor_parallel_size {tp} x pipeline_parallel_size {pp}"
    if dp > 1:
        shape += f" x data_parallel_size {dp}"
    raise PlacementError(
        f"placement: {shape} needs {needed} TP "
        f"group(s) of {tp} {resource}, each on one node (a TP group never spans nodes), but "
        f"{what}: {_describe_nodes(capacities, resource, tp)}; add nodes with {tp} {resource} "
        "or lower tensor_parallel_size"
    )


def _describe_nodes(capacities: dict[str, float], resource: str, tp: int | None = None) -> str:
    parts = []
    for node, amount in capacities.items():
        part = f"{node} has {amount:g} {resource}"
        if tp is not None:
            groups = int(amount // tp)
            part += f" ({groups} TP group(s))" if groups else f" ({tp - amount:g} short of one)"
        parts.append(part)
    return "; ".join(parts) or "none alive"
