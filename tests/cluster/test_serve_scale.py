"""Scale on a local Ray with the real engine (configs/tiny.yaml as the base):

- prefix-aware routing over 2 replicas: a shared-prefix workload keeps >= 90 % of the prefix
  hit rate one replica reaches alone, and no replica takes more than 70 % of the traffic;
- the engine-signal autoscaling policy with ``min_replicas: 0``: a request to the model at 0
  replicas succeeds after the cold start, load scales it up, idleness back to 0; a model whose
  cold start outlasts ``cold_start_timeout_s`` answers 503 with Retry-After, never 404.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cluster.bench.prefix import PrefixWorkload, cache_summary, run_workload
from cluster.bench.soak import ServeProbe
from tests.cluster.conftest import ServeCluster, load_yaml, wait_for

MODEL = "tiny-llama"
WORKLOAD = PrefixWorkload(num_prefixes=4, prefix_tokens=256, num_requests=40, rate_per_s=4.0,
                          max_tokens=4)  # fmt: skip


def tiny(**deployment: Any) -> dict[str, Any]:
    config = copy.deepcopy(load_yaml("tiny.yaml"))
    model = config["models"][0]
    model["engine_kwargs"]["num_kv_blocks"] = 512
    model["deployment_config"].pop("num_replicas")
    model["deployment_config"].update(deployment)
    return config


def run_prefix_workload(cluster: ServeCluster, config: dict[str, Any], app: str) -> dict[str, Any]:
    from ray import serve

    url = cluster.deploy(config, app, f"/{app}")
    try:
        probe = ServeProbe(app, MODEL)
        before = probe.each_replica("stats")
        load = asyncio.run(run_workload(url, MODEL, WORKLOAD))
        after = probe.each_replica("stats")
    finally:
        serve.delete(app)
    return {**load, **cache_summary(before, after)}


@pytest.fixture(scope="module")
def prefix_runs(serve_cluster: ServeCluster) -> dict[str, dict[str, Any]]:
    one = run_prefix_workload(serve_cluster, tiny(num_replicas=1), "prefix1")
    two = run_prefix_workload(serve_cluster, tiny(num_replicas=2), "prefix2")
    print({"one": one, "two": two})
    return {"one": one, "two": two}


def test_prefix_aware_routing_keeps_90_percent_of_one_replicas_hit_rate(
    prefix_runs: dict[str, dict[str, Any]],
) -> None:
    one, two = prefix_runs["one"], prefix_runs["two"]
    assert one["failed"] == two["failed"] == 0
    assert len(two["replica_share"]) == 2
    assert one["prefix_hit_rate"] > 0.5
    assert two["prefix_hit_rate"] >= 0.9 * one["prefix_hit_rate"], prefix_runs


def test_uniform_prefixes_leave_no_replica_above_70_percent_of_the_traffic(
    prefix_runs: dict[str, dict[str, Any]],
) -> None:
    shares = prefix_runs["two"]["replica_share"]
    assert max(shares.values()) <= 0.7, shares


# ---- autoscaling on engine signals, to and from zero -----------------------------------------

APP = "scale"
SLOW = "tiny-cold"  # a second model whose cold start outlasts its cold_start_timeout_s


@pytest.fixture(scope="module")
def scaled(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    config = tiny(
        autoscaling_config={
            "min_replicas": 0,
            "initial_replicas": 0,
            "max_replicas": 2,
            "target_ongoing_requests": 2,
            "target_num_waiting": 1,
            "upscale_delay_s": 0,
            "downscale_delay_s": 3,
            "downscale_to_zero_delay_s": 3,
            "look_back_period_s": 2,
            "metrics_interval_s": 0.5,
        }
    )
    config["models"][0]["engine_kwargs"]["max_num_seqs"] = 2  # a queue forms at 3 requests
    slow = copy.deepcopy(config["models"][0])
    slow["model_loading_config"]["model_id"] = SLOW
    slow["deployment_config"]["cold_start_timeout_s"] = 0.5
    slow["deployment_config"]["autoscaling_config"]["max_replicas"] = 1
    config["models"].append(slow)
    url = serve_cluster.deploy(config, APP, f"/{APP}")
    yield url
    serve.delete(APP)


def running(model: str) -> int:
    return ServeProbe(APP, model).num_replicas()


def complete(url: str, model: str, max_tokens: int = 4, timeout_s: float = 300) -> httpx.Response:
    body = {"model": model, "prompt": "hello there", "max_tokens": max_tokens,
            "ignore_eos": True}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)


def test_a_request_to_a_model_at_zero_replicas_succeeds_after_the_cold_start(scaled: str) -> None:
    assert running(MODEL) == 0
    start = time.monotonic()
    response = complete(scaled, MODEL)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert running(MODEL) >= 1
    print(f"cold start: {time.monotonic() - start:.1f} s")


def test_health_does_not_wake_a_model_at_zero_replicas(scaled: str) -> None:
    assert running(SLOW) == 0
    response = httpx.get(f"{scaled}/health", timeout=30)
    assert response.status_code == 200, response.text
    time.sleep(2)
    assert running(SLOW) == 0


def test_load_scales_up_on_the_queue(scaled: str) -> None:
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            complete(scaled, MODEL, max_tokens=64)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: running(MODEL) == 2, 180, "a second replica under load")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def test_routing_and_autoscaling_decisions_are_in_the_metrics(scaled: str) -> None:
    names = (
        "llm_cluster_routing_decisions_total",
        "llm_cluster_autoscaling_decisions_total",
        "llm_cluster_autoscaling_desired_replicas",
        "llm_cluster_prefix_cache_hit_rate",
    )
    missing: list[str] = []

    def scraped() -> bool:
        text = httpx.get(f"{scaled}/metrics", timeout=30).text
        missing[:] = [n for n in names if f"{n}{{" not in text or f'model="{MODEL}"' not in text]
        return not missing

    try:
        wait_for(scraped, timeout_s=60, what="routing and autoscaling metrics", poll_s=2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; missing: {missing}") from None


def test_idle_scales_down_to_zero(scaled: str) -> None:
    wait_for(lambda: running(MODEL) == 0, 180, "scale-down to 0 replicas when idle")


def test_a_cold_start_past_its_timeout_is_503_with_retry_after_never_404(scaled: str) -> None:
    assert running(SLOW) == 0
    response = complete(scaled, SLOW)
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "10"
    assert response.json()["error"]["code"] == "cold_start"
    # The request started a replica: a retry once it is up succeeds.
    wait_for(lambda: running(SLOW) == 1, 180, "the cold model's replica")
    assert complete(scaled, SLOW).status_code == 200
