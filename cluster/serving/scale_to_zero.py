"""Scale to zero, seen from the ingress: how many replicas of a model run (Serve's status; a
health check must not start one, ``cluster.serving.readiness``), and the 503 a request gets
when its model, starting from zero, does not answer in time."""

from __future__ import annotations

from typing import Any

from cluster.api.api_errors import APIError

COLD_START_RETRY_AFTER_S = 10


def running_replicas(replica_states: dict[Any, int]) -> int:
    """The RUNNING replicas in a deployment's ``replica_states`` (Serve's status)."""
    return sum(n for s, n in replica_states.items() if getattr(s, "value", s) == "RUNNING")


def cold_start_error(model: str, timeout_s: float) -> APIError:
    return APIError(503, f"model {model!r} is starting (it was scaled to zero) and did not "
                    f"answer within {timeout_s:.0f} s; retry later", None, "cold_start",
                    retry_after=COLD_START_RETRY_AFTER_S)  # fmt: skip


__all__ = [
    "COLD_START_RETRY_AFTER_S",
    "cold_start_error",
    "running_replicas",
]
