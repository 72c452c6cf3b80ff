"""configs/multi-model.yaml: two models behind one endpoint, routed by name; the autoscaled one
goes from 1 to 2 replicas under sustained load and back to 1 after it (short delays here)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator

import pytest
from openai import NotFoundError, OpenAI

from tests.cluster.conftest import ServeCluster, load_yaml, wait_for

APP = "multi"
SCALED = "tiny-qwen2"


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster) -> Iterator[OpenAI]:
    from ray import serve

    config = copy.deepcopy(load_yaml("multi-model.yaml"))
    scaled = next(m for m in config["models"] if m["model_loading_config"]["model_id"] == SCALED)
    scaled["deployment_config"]["autoscaling_config"].update(
        target_ongoing_requests=1,
        upscale_delay_s=1,
        downscale_delay_s=3,
        look_back_period_s=2,
        metrics_interval_s=0.5,
    )
    url = serve_cluster.deploy(config, APP, "/multi")
    yield OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0)
    serve.delete(APP)


def running_replicas(model_id: str) -> int:
    from ray import serve

    deployment = serve.status().applications[APP].deployments[f"LLMServer:{model_id}"]
    states = deployment.replica_states
    return sum(n for state, n in states.items() if getattr(state, "value", state) == "RUNNING")


def test_both_models_answer_by_name(client: OpenAI) -> None:
    assert sorted(m.id for m in client.models.list().data) == ["tiny-llama", "tiny-qwen2"]
    for model in ("tiny-llama", "tiny-qwen2"):
        response = client.completions.create(model=model, prompt="hello", max_tokens=3)
        assert (response.model, response.usage.completion_tokens) == (model, 3)


def test_unknown_model_name_is_404(client: OpenAI) -> None:
    with pytest.raises(NotFoundError):
        client.chat.completions.create(
            model="tiny-gpt", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


def test_autoscaled_model_scales_up_under_load_and_back_down(client: OpenAI) -> None:
    assert running_replicas(SCALED) == 1
    stop = threading.Event()
    errors: list[BaseException] = []

    def load() -> None:
        while not stop.is_set():
            try:
                client.completions.create(
                    model=SCALED, prompt="load", max_tokens=400, extra_body={"ignore_eos": True}
                )
            except BaseException as exc:  # surfaced after the threads stop
                errors.append(exc)
                return

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: running_replicas(SCALED) == 2, 150, "a second replica under load", 1)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not errors
    wait_for(lambda: running_replicas(SCALED) == 1, 120, "scale-down to one replica", 1)


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow
