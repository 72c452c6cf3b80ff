"""Can the Ray cluster host one replica of each model? Checked by ``cluster deploy`` while it
waits for the deployments.

A Serve replica's placement group (``ModelDeployment.placement_group_bundles``: front, head,
one ``{GPU: TP}`` bundle per pipeline stage) that no set of nodes can hold stays pending, and
Serve says only that the replica is starting. So ``deploy`` compares the bundles with the
nodes as it starts and at every poll, and names the shortfall per node the moment it sees one
(and again when it changes or clears): the nodes alive now plus the node types an autoscaler
may still add (the autoscaler's cluster config in the GCS, as ``ray up`` and KubeRay write it:
each node group's resources and ``max_count``). It does not refuse: nodes may join a cluster
without an autoscaler while the deployment waits (``ray start --address`` on a new machine),
and Serve places the replica then. Only what cannot be placed on those nodes is reported
(necessary conditions, so a deployment that fits is never reported):

- each pipeline stage's TP group needs one node with TP devices (of ``accelerator_type`` when
  one is named), and there must be one such group per stage (``check_nodes_can_host``, the
  same check the executor makes for its own placement group); a one-worker replica on a
  fraction of a device (``placement_group_config.bundles``) needs a node with that fraction;
- every resource in all the bundles together must not exceed the nodes' total.

A disaggregated model is checked per pool (``ModelDeployment.pools``: each its own Serve
deployment, with its own TP and bundles), reported as ``m (prefill)`` and ``m (decode)``.

What is free now is not checked: other replicas may release it, and Serve waits for it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from cluster.config import DeploymentConfig, ModelDeployment
from cluster.ops.plan import pool_name
from cluster.runtime.placement import PlacementError, _describe_nodes, check_nodes_can_host

Nodes = Mapping[str, Mapping[str, float]]


def cluster_nodes() -> dict[str, dict[str, float]]:
    """Each alive node's total resources, plus each node type the autoscaler may add (as
    many nodes as its ``max_count``, at most 16 shown), by a readable name."""
    import ray

    nodes = {
        f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]})": dict(node["Resources"])
        for node in ray.nodes()
        if node.get("Alive")
    }
    nodes.update(autoscaling_nodes(_autoscaler_config()))
    return nodes


def _autoscaler_config() -> Any:
    try:
        from ray._private.state import state

        return state.get_cluster_config()
    except Exception:  # no autoscaler state (a plain ray start): nothing may be added
        return None


def autoscaling_nodes(cluster_config: Any, limit: int = 16) -> dict[str, dict[str, float]]:
    """The nodes an autoscaler's ``ClusterConfig`` (``node_group_configs``: ``name``,
    ``resources``, ``max_count``, -1 for unbounded) may add."""
    nodes: dict[str, dict[str, float]] = {}
    if cluster_config is None:
        return nodes
    for group in cluster_config.node_group_configs:
        count = group.max_count if group.max_count >= 0 else sys.maxsize
        resources = {key: float(value) for key, value in group.resources.items()}
        for i in range(min(count, limit)):
            nodes[f"autoscaler node type {group.name!r} #{i + 1}"] = resources
    return nodes


def replica_shortfall(model: ModelDeployment, nodes: Nodes) -> str | None:
    """Why ``nodes`` can never hold one replica of ``model``; None when they might."""
    bundles = model.placement_group_bundles()
    unit = "GPU" if model.uses_gpu else "CPU"
    accelerator = f"accelerator_type:{model.accelerator_type}" if model.uses_gpu else None
    if model.accelerator_type and model.uses_gpu:
        eligible = {name: res for name, res in nodes.items() if res.get(accelerator or "", 0) > 0}
    else:
        eligible = dict(nodes)
    kw = model.engine_kwargs
    tp = int(kw.get("tensor_parallel_size", 1))
    pp = int(kw.get("pipeline_parallel_size", 1))
    dp = int(kw.get("data_parallel_size", 1))
    capacities = {name: float(res.get(unit, 0.0)) for name, res in eligible.items()}
    if model.accelerator_type and model.uses_gpu and not eligible:
        return (
            f"no node has accelerator_type {model.accelerator_type!r} (resource "
            f"{accelerator!r}); nodes: {', '.join(nodes) or 'none alive'}"
        )
    share = model.placement_group_config.device_share(unit)
    if share < 1:
        # One worker on a fraction of a device (placement_group_config.bundles): one node with
        # that much of one is enough.
        if not any(amount >= share for amount in capacities.values()):
            return (
                f"no node has the {share:g} {unit} the replica's worker needs "
                f"(placement_group_config.bundles): {_describe_nodes(capacities, unit)}"
            )
    else:
        try:
            strategy = model.placement_group_config.strategy
            check_nodes_can_host(capacities, tp, pp, unit, strategy, dp)
        except PlacementError as exc:
            return str(exc)
    needed: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            needed[key] = needed.get(key, 0.0) + amount
    for key, amount in needed.items():
        total = sum(res.get(key, 0.0) for res in nodes.values())
        if total < amount:
            return (
                f"a replica's placement group {bundles} needs {amount:g} {key} in all, but the "
                f"cluster's nodes have {total:g} ({amount - total:g} short)"
            )
    return None


def placement_shortfalls(config: DeploymentConfig, nodes: Nodes | None = None) -> dict[str, str]:
    """Model id (a disaggregated model's pool: ``m (prefill)``) -> why the cluster's nodes
    (``nodes``: name -> total resources; default: the connected cluster's) cannot hold one of
    its replicas; only the models that cannot."""
    nodes = cluster_nodes() if nodes is None else nodes
    shortfalls = {}
    for model in config.models:
        for role, pool in model.pools():
            why = replica_shortfall(pool, nodes)
            if why is not None:
                shortfalls[pool_name(model.model_id, role)] = why
    return shortfalls


def report_shortfalls(
    config: DeploymentConfig, progress: Callable[[str], None], before: dict[str, str]
) -> dict[str, str]:
    """Tell ``progress`` about each model whose replica the cluster cannot hold now, once per
    change (and when it can again); returns the current shortfalls for the next call."""
    now = placement_shortfalls(config)
    for model_id, why in now.items():
        if before.get(model_id) != why:
            progress(
                f"  {model_id}: the cluster cannot place a replica now (waiting for nodes to "
                f"join): {why}"
            )
    for model_id in before.keys() - now.keys():
        progress(f"  {model_id}: the cluster's nodes can now hold a replica")
    return now
