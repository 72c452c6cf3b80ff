"""Scale to and from zero on a local Ray with the real engine (configs/tiny.yaml as the base),
under the engine-signal autoscaling policy with ``min_replicas: 0``: a request to the model at 0
replicas succeeds after the cold start, idleness brings it back to 0, and a model whose cold start
outlasts ``cold_start_timeout_s`` answers 503 with Retry-After, never 404. Scaling up under load
with the same policy: ``test_serve_multi_model.py``. Prefix-aware routing over 2 replicas:
``test_serve_openai_features.py`` (behaviour) and ``cluster bench prefix`` (hit rates,
BENCHMARKS.md).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cluster.bench.soak import ServeProbe
from tests.cluster.conftest import ServeCluster, load_yaml, wait_for

MODEL = "tiny-llama"


def tiny(**deployment: Any) -> dict[str, Any]:
    config = copy.deepcopy(load_yaml("tiny.yaml"))
    model = config["models"][0]
    model["engine_kwargs"]["num_kv_blocks"] = 512
    model["deployment_config"].pop("num_replicas")
    model["deployment_config"].update(deployment)
    return config


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


def test_routing_and_autoscaling_decisions_are_in_the_metrics(scaled: str) -> None:
    names = (
        "ray_llm_cluster_routing_decisions_total",
        "ray_llm_cluster_autoscaling_decisions_total",
        "ray_llm_cluster_autoscaling_desired_replicas",
        "ray_llm_cluster_prefix_cache_hit_rate",
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


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow
