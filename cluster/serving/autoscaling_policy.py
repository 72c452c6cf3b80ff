"""Serve autoscaling on engine signals: a replica count from ongoing requests, the engines'
waiting queues and their KV usage, and whether they sleep (each replica reports the rest through
``LLMServer.record_autoscaling_stats``; Serve's controller averages them over
``look_back_period_s``).

    by_requests = total ongoing requests / target_ongoing_requests
    by_waiting  = replicas x mean waiting per replica / target_num_waiting
    by_kv       = replicas x mean KV usage / target_kv_usage          (only when above target)
    desired     = max(by_requests, by_waiting, by_kv)
                  (held at the current count while a replica sleeps: it wakes for the load
                  in seconds, a new replica would take a cold start and more devices)

Ongoing requests alone miss an engine that holds few requests but cannot admit them (a full
KV cache, long prompts queued behind each other); the waiting queue and KV usage are what the
engine is short of. Serve wraps the policy: ``min_replicas`` / ``max_replicas``, the up- and
down-scale delays (``downscale_to_zero_delay_s`` for the last step to 0) and the start from
zero (a request queued at a handle of a model at 0 replicas starts one at once) are applied
outside it.

Serve ships this module by value to its controller, which cannot import this project: it
imports only the standard library and Ray.
"""

from __future__ import annotations

import math
from typing import Any

_METRICS: dict[str, Any] = {}
_LAST_ASK = "llm_cluster_last_ask"  # policy state: the count asked for at the last tick


class EngineSignalPolicy:
    """Serve's class-callable policy: built once with ``policy_kwargs``, called every tick."""

    def __init__(self, target_num_waiting: float = 2.0, target_kv_usage: float = 0.85) -> None:
        if not target_num_waiting > 0:
            raise ValueError(f"target_num_waiting: must be > 0, got {target_num_waiting}")
        if not 0 < target_kv_usage <= 1:
            raise ValueError(f"target_kv_usage: must be in (0, 1], got {target_kv_usage}")
        self.target_num_waiting = target_num_waiting
        self.target_kv_usage = target_kv_usage

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        state = dict(ctx.policy_state or {})
        desired, signal = self.desired_replicas(ctx)
        wanted = math.ceil(desired)
        if wanted != state.get(_LAST_ASK) and wanted != ctx.current_num_replicas:
            _record_decision(ctx, wanted, signal)
        state[_LAST_ASK] = wanted
        _record_desired(ctx, wanted)
        return desired, state

    def desired_replicas(self, ctx: Any) -> tuple[float, str]:
        """The replica count before Serve's bounds and delays, and the signal that set it."""
        replicas = ctx.current_num_replicas
        if replicas == 0:
            return float(ctx.target_num_replicas), "none"
        target_ongoing = ctx.config.get_target_ongoing_requests()
        by_requests = ctx.total_num_requests / target_ongoing
        metrics = ctx.aggregated_metrics or {}
        waiting = _mean(metrics.get("num_waiting"))
        kv_usage = _mean(metrics.get("kv_usage"))
        candidates = {
            "ongoing_requests": by_requests,
            "num_waiting": replicas * waiting / self.target_num_waiting,
            # KV usage only pushes up: a cache that is mostly free says nothing about how few
            # replicas would do (prefix caching keeps blocks warm on purpose).
            "kv_usage": replicas * kv_usage / self.target_kv_usage
            if kv_usage > self.target_kv_usage
            else 0.0,
        }
        signal = max(candidates, key=lambda k: candidates[k])
        if candidates[signal] > replicas and _mean(metrics.get("asleep")) > 0:
            return float(replicas), "asleep"
        return candidates[signal], signal


def _mean(per_replica: dict[Any, float] | None) -> float:
    values = [v for v in (per_replica or {}).values() if isinstance(v, (int, float))]
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else 0.0


def _metrics() -> dict[str, Any]:
    if not _METRICS:
        from ray.util.metrics import Counter, Gauge

        _METRICS["desired"] = Gauge(
            "llm_cluster_autoscaling_desired_replicas",
            "Replicas the engine-signal policy asks for, before bounds and delays.",
            tag_keys=("model",),
        )
        _METRICS["decisions"] = Counter(
            "llm_cluster_autoscaling_decisions_total",
            "Changes of the policy's ask away from the current count: direction, signal.",
            tag_keys=("model", "direction", "signal"),
        )
    return _METRICS


def _model(ctx: Any) -> str:
    return str(ctx.deployment_name).removeprefix("LLMServer:")


def _record_desired(ctx: Any, wanted: int) -> None:
    try:
        _metrics()["desired"].set(wanted, {"model": _model(ctx)})
    except Exception:  # metrics never decide the scaling
        return


def _record_decision(ctx: Any, wanted: int, signal: str) -> None:
    direction = "up" if wanted > ctx.current_num_replicas else "down"
    try:
        tags = {"model": _model(ctx), "direction": direction, "signal": signal}
        _metrics()["decisions"].inc(1, tags)
    except Exception:
        return
