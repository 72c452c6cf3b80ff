"""Whether the application can serve: what the ingress's ``GET /health`` (and the gRPC ``Health``
RPC) answer. Readiness, for load balancers and Kubernetes' readiness probes; ``GET /livez`` is the
liveness path (the ingress answers at all).

A model is ready once Serve runs a replica of it and that replica's engine answers its health
check, or, without asking, while its streams bring items (an engine stepping now): a replica
whose every request slot is taken answers only once one frees, so asking would make a
saturated model look dead to a probe, and out of service when it is busiest. One that scales
to zero is ready at zero replicas (a request starts one; a health check must not). Until every
model is ready ``/health`` is a 503 naming each model that is not and why: its replicas still
starting (with its workers' start-up phase, ``cluster.runtime.load_progress``), or its engine
dead. Serve's status says which models have a running replica without waiting on one: a health
call to a model whose replica still loads would wait for the load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.config import deployment_name
from cluster.runtime.load_progress import describe, read_load_progress
from cluster.serving.ingress_calls import model_health, streamed_within

HEALTH_TIMEOUT_S = 10.0  # a running replica that does not answer in this long is unhealthy
STREAMING_S = 5.0  # a model whose streams brought an item this recently is serving


def replica_states(models: Iterable[str]) -> dict[str, dict[str, int]] | None:
    """Each model's replicas by state (``{"RUNNING": 1, "STARTING": 1}``), from Serve's status
    of the application this replica serves; None when the status is unreachable. Blocking (a
    call to Serve's controller): run it off the event loop."""
    try:
        # The context first: outside a replica, serve.status() would start a Ray of its own.
        app_name = serve.get_replica_context().app_name
        app = serve.status().applications[app_name]
    except Exception:  # not in a replica, or the status unreachable
        return None
    states = {}
    for model in models:
        deployment = app.deployments.get(deployment_name(model))
        replicas = deployment.replica_states if deployment is not None else {}
        states[model] = {getattr(s, "value", str(s)): n for s, n in replicas.items() if n}
    return states


async def unready_models(
    servers: dict[str, DeploymentHandle], scales_to_zero: Iterable[str] = ()
) -> dict[str, str]:
    """The models of ``servers`` that cannot serve now, each with its reason; empty: ready."""
    states = await asyncio.to_thread(replica_states, servers)
    idle_ok = set(scales_to_zero)
    problems = {}
    for model, handle in servers.items():
        replicas = states.get(model) if states is not None else None
        if replicas is not None and not replicas.get("RUNNING"):
            if model not in idle_ok:
                problems[model] = await asyncio.to_thread(_not_running_reason, model, replicas)
            continue
        if streamed_within(model, STREAMING_S):
            continue
        status = await model_health(handle, HEALTH_TIMEOUT_S)
        if not status["healthy"]:
            problems[model] = status.get("error", "unhealthy")
    return problems


def _not_running_reason(model: str, replicas: dict[str, int]) -> str:
    """ "not ready: no replica running yet (1 starting; rank 0: loading weights 56%)"."""
    counts = [f"{n} {state.lower()}" for state, n in sorted(replicas.items())]
    for record in _load_progress(model):
        where = f"rank {record['rank']}: {record['phase']}"
        if record.get("percent") is not None and record["phase"] == "loading weights":
            where += f" {record['percent']:.0f}%"
        counts.append(where)
        break  # one worker says enough; ``cluster status`` lists them all
    return "not ready: no replica running yet" + (f" ({'; '.join(counts)})" if counts else "")


def _load_progress(model: str) -> list[dict[str, Any]]:
    now = time.time()
    records = [describe(r, now) for r in read_load_progress(now=now) if r.get("model_id") == model]
    return sorted(records, key=lambda r: r["rank"])


__all__ = ["HEALTH_TIMEOUT_S", "replica_states", "unready_models"]
