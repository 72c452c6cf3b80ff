"""The engine-signal autoscaling policy on fake contexts (Serve's ``AutoscalingContext``
fields it reads), and that Serve's wrapper applies bounds, delays and the start from zero."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from cluster.serving.autoscaling_policy import EngineSignalPolicy


def context(
    replicas: int,
    ongoing: float,
    waiting: list[float] | None = None,
    kv: list[float] | None = None,
    target_ongoing: float = 8.0,
) -> Any:
    metrics = {}
    if waiting is not None:
        metrics["num_waiting"] = {f"r{i}": w for i, w in enumerate(waiting)}
    if kv is not None:
        metrics["kv_usage"] = {f"r{i}": u for i, u in enumerate(kv)}
    return SimpleNamespace(
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        total_num_requests=ongoing,
        aggregated_metrics=metrics,
        policy_state={},
        deployment_name="LLMServer:tiny",
        config=SimpleNamespace(get_target_ongoing_requests=lambda: target_ongoing),
    )


POLICY = EngineSignalPolicy(target_num_waiting=2.0, target_kv_usage=0.8)


def test_ongoing_requests_alone_scale_like_serves_default() -> None:
    assert POLICY.desired_replicas(context(2, 32)) == (4.0, "ongoing_requests")


def test_a_waiting_queue_scales_up_even_with_few_ongoing_requests() -> None:
    desired, signal = POLICY.desired_replicas(context(1, 4, waiting=[6]))
    assert (desired, signal) == (3.0, "num_waiting")


def test_kv_usage_above_target_scales_up_and_below_target_says_nothing() -> None:
    desired, signal = POLICY.desired_replicas(context(2, 2, kv=[1.0, 0.92]))
    assert signal == "kv_usage" and desired == pytest.approx(2 * 0.96 / 0.8)
    assert POLICY.desired_replicas(context(2, 0, kv=[0.7, 0.7])) == (0.0, "ongoing_requests")


def test_idle_asks_for_zero_replicas_and_serve_bounds_it_by_min_replicas() -> None:
    desired, state = POLICY(context(1, 0, waiting=[0], kv=[0.0]))
    assert desired == 0.0 and state["llm_cluster_last_ask"] == 0


def test_no_replica_is_added_while_one_sleeps_and_the_count_may_still_fall() -> None:
    ctx = context(2, 64, waiting=[8, 0])
    ctx.aggregated_metrics["asleep"] = {"r0": 0.0, "r1": 1.0}
    assert POLICY.desired_replicas(ctx) == (2.0, "asleep")
    ctx.aggregated_metrics["asleep"] = {"r0": 0.0, "r1": 0.0}
    assert POLICY.desired_replicas(ctx) == (8.0, "ongoing_requests")
    idle = context(2, 0)
    idle.aggregated_metrics["asleep"] = {"r0": 1.0, "r1": 1.0}
    assert POLICY.desired_replicas(idle) == (0.0, "ongoing_requests")


def test_bad_targets_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="target_num_waiting"):
        EngineSignalPolicy(target_num_waiting=0)
    with pytest.raises(ValueError, match="target_kv_usage"):
        EngineSignalPolicy(target_kv_usage=1.5)


def serve_context(current: int, ongoing: float, waiting: list[float], **scaling: Any) -> Any:
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    config = AutoscalingConfig(target_ongoing_requests=8, **scaling)
    return AutoscalingContext(
        deployment_id=DeploymentID(name="LLMServer:tiny", app_name="llm"),
        deployment_name="LLMServer:tiny",
        app_name="llm",
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=[],
        total_num_requests=ongoing,
        total_queued_requests=0.0,
        aggregated_metrics={"num_waiting": {f"r{i}": w for i, w in enumerate(waiting)}},
        raw_metrics={},
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=config,
    )


def test_serves_wrapper_scales_from_zero_at_once_and_follows_the_queue_both_ways() -> None:
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    policy = _apply_autoscaling_config(EngineSignalPolicy())
    scaling = {"min_replicas": 0, "max_replicas": 2, "upscale_delay_s": 0,
               "downscale_delay_s": 0}  # fmt: skip
    assert policy(serve_context(0, 1, [], **scaling))[0] == 1  # a queued request: cold start
    # Waiting 5 per replica against a target of 2: 2.5 -> 3 (Serve caps it at max_replicas
    # after the policy, in the deployment's autoscaling state).
    assert policy(serve_context(1, 2, [5], **scaling))[0] == 3
    assert policy(serve_context(1, 0, [0], **scaling))[0] == 0  # idle: to zero
