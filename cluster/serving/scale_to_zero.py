"""Scale to zero, seen from the ingress: which models have no running replica now (a health
check must not start one), and the 503 a request gets when its model, starting from zero,
does not answer in time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ray import serve

from cluster.api.api_errors import APIError
from cluster.config import deployment_name

COLD_START_RETRY_AFTER_S = 10


def running_replicas(replica_states: dict[Any, int]) -> int:
    """The RUNNING replicas in a deployment's ``replica_states`` (Serve's status)."""
    return sum(n for s, n in replica_states.items() if getattr(s, "value", s) == "RUNNING")


def models_without_replicas(models: Iterable[str]) -> set[str]:
    """Those of ``models`` with no running replica now, by Serve's status of the app this
    replica serves; none when the status is unreachable (then every model is checked)."""
    try:
        app = serve.status().applications[serve.get_replica_context().app_name]
    except Exception:  # status unreachable
        return set()
    idle = set()
    for model in models:
        deployment = app.deployments.get(deployment_name(model))
        states = deployment.replica_states if deployment is not None else {}
        if not running_replicas(states):
            idle.add(model)
    return idle


def cold_start_error(model: str, timeout_s: float) -> APIError:
    return APIError(503, f"model {model!r} is starting (it was scaled to zero) and did not "
                    f"answer within {timeout_s:.0f} s; retry later", None, "cold_start",
                    retry_after=COLD_START_RETRY_AFTER_S)  # fmt: skip


__all__ = [
    "COLD_START_RETRY_AFTER_S",
    "cold_start_error",
    "models_without_replicas",
    "running_replicas",
]
