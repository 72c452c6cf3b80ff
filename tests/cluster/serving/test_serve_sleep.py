"""Sleep mode through Serve, with the official ``openai`` client: three tiny models on room for
two (``sleep_mode.max_awake_models: 2``): the third starts asleep with no engine, then all answer
in turn, each with its own greedy tokens, while at most two are awake; the admin routes
(``/sleep``, ``/wake_up``, ``/is_sleeping``) behind the API key; a request wakes a model put to
sleep (level 1 or 2) and gets the same tokens; a busy model refuses to sleep (409) and its stream
completes; ``sleep_after_idle_s`` puts an idle model to sleep; ``/metrics`` counts sleeps and
wakes; ``cluster sleep`` / ``cluster wake``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.cluster.conftest import ServeCluster, load_yaml, wait_for

APP = "sleepy"
KEY = "sk-sleep-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODELS = ("nap-a", "nap-b", "nap-c")
SOURCES = ("builtin:tiny-llama", "builtin:tiny-qwen2", "builtin:tiny-mistral")
IDLE_S = 4.0  # nap-c's sleep_after_idle_s

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_url(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    template = load_yaml("tiny.yaml")["models"][0]
    models = []
    for name, source in zip(MODELS, SOURCES, strict=True):
        model: dict[str, Any] = {**template, "model_loading_config": {
            "model_id": name, "model_source": source}}  # fmt: skip
        model["engine_kwargs"] = {**template["engine_kwargs"], "num_kv_blocks": 64}
        model["sleep_config"] = {"level": 2 if name == "nap-b" else 1, "wake_timeout_s": 60}
        if name == "nap-c":
            model["sleep_config"]["sleep_after_idle_s"] = IDLE_S
        models.append(model)
    config = {**load_yaml("tiny.yaml"), "models": models,
              "sleep_mode": {"max_awake_models": 2}}  # fmt: skip
    yield serve_cluster.deploy(config, APP, f"/{APP}", api_keys=KEY)
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(client: OpenAI, model: str, text: str = "Tell me a story", n: int = 8) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=n, temperature=0
    )
    return reply.choices[0].message.content or ""


def _admin(base_url: str, method: str, route: str, **params: Any) -> httpx.Response:
    return httpx.request(method, f"{base_url}{route}", params=params, headers=AUTH, timeout=120)


def _asleep(base_url: str, model: str) -> bool:
    reply = _admin(base_url, "GET", "/is_sleeping", model=model)
    assert reply.status_code == 200, reply.text
    return reply.json()["is_sleeping"]


def _heads_of(model: str) -> list[str]:
    import ray

    from cluster.serving.head_actor import HEAD_NAME_PREFIX

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return [n for n in names if n.startswith(f"{HEAD_NAME_PREFIX}{model}:")]


def test_the_model_beyond_the_limit_starts_asleep_without_an_engine(base_url: str) -> None:
    assert [_asleep(base_url, m) for m in MODELS] == [False, False, True]
    assert _heads_of("nap-c") == [] and len(_heads_of("nap-a")) == 1
    state = _admin(base_url, "GET", "/is_sleeping", model="nap-c").json()
    assert state["sleep_level"] == 2


def test_three_models_on_room_for_two_answer_in_turn(client: OpenAI, base_url: str) -> None:
    first = {m: _chat(client, m) for m in MODELS}
    assert len(set(first.values())) == 3  # three models, three answers
    for _ in range(2):
        for model in MODELS:
            assert _chat(client, model) == first[model]
            awake = [m for m in MODELS if not _asleep(base_url, m)]
            assert model in awake and len(awake) <= 2, awake
    metrics = httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=60).text
    names = {line.split("{", 1)[0] for line in metrics.splitlines()}
    assert {"ray_llm_cluster_wakes_total", "ray_llm_cluster_sleeps_total"} <= names


@pytest.mark.parametrize("level", [1, 2])
def test_a_model_put_to_sleep_wakes_for_a_request_with_the_same_tokens(
    client: OpenAI, base_url: str, level: int
) -> None:
    before = _chat(client, "nap-a", "Once upon a time")
    reply = _admin(base_url, "POST", "/sleep", model="nap-a", level=level)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"model": "nap-a", "is_sleeping": True, "replicas": 1,
                            "sleep_level": level}  # fmt: skip
    assert _chat(client, "nap-a", "Once upon a time") == before
    assert not _asleep(base_url, "nap-a")


def test_wake_up_route_wakes_a_sleeping_model(base_url: str) -> None:
    assert _admin(base_url, "POST", "/sleep", model="nap-a", level=2).status_code == 200
    tags = _admin(base_url, "POST", "/wake_up", model="nap-a", tags="everything")
    assert tags.status_code == 400 and "tags" in tags.json()["error"]["message"]
    first = _admin(base_url, "POST", "/wake_up", model="nap-a", tags="weights")
    assert first.status_code == 200 and first.json()["is_sleeping"] is True  # its cache sleeps
    reply = _admin(base_url, "POST", "/wake_up", model="nap-a")
    assert reply.status_code == 200 and reply.json()["is_sleeping"] is False


def test_a_busy_model_refuses_to_sleep_and_finishes_its_stream(
    client: OpenAI, base_url: str
) -> None:
    _chat(client, "nap-a")  # awake
    stream = client.chat.completions.create(
        model="nap-a", messages=[{"role": "user", "content": "A long one"}], max_tokens=400,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)  # the request is in flight
    pieces: list[Any] = []
    reader = threading.Thread(target=lambda: pieces.extend(chunks))
    reader.start()
    reply = _admin(base_url, "POST", "/sleep", model="nap-a")
    reader.join(120)
    assert reply.status_code == 409 and "in flight" in reply.json()["error"]["message"]
    assert pieces[-1].choices[0].finish_reason == "length"


def test_an_idle_model_falls_asleep_after_its_idle_time(client: OpenAI, base_url: str) -> None:
    _chat(client, "nap-c")
    wait_for(lambda: _asleep(base_url, "nap-c"), IDLE_S + 15, "nap-c asleep after its idle time")
    assert _chat(client, "nap-c")  # and it wakes for the next request


def test_cluster_sleep_and_wake_commands(base_url: str, capsys: pytest.CaptureFixture) -> None:
    from cluster.cli import main

    assert main(["sleep", "nap-b", "--app", APP, "--level", "2"]) == 0
    assert "nap-b: asleep (level 2), 1 replica(s)" in capsys.readouterr().out
    assert _asleep(base_url, "nap-b")
    assert main(["wake", "nap-b", "--app", APP]) == 0
    assert "nap-b: awake, 1 replica(s)" in capsys.readouterr().out
    assert not _asleep(base_url, "nap-b")
    assert main(["sleep", "nap-z", "--app", APP]) == 2
    assert "The model `nap-z` does not exist" in capsys.readouterr().err


def test_admin_routes_check_the_key_the_model_and_the_level(base_url: str) -> None:
    no_key = httpx.post(f"{base_url}/sleep", params={"model": "nap-a"}, timeout=30)
    assert no_key.status_code == 401
    unknown = _admin(base_url, "POST", "/sleep", model="nap-z")
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    several = _admin(base_url, "POST", "/sleep")
    assert several.status_code == 400 and several.json()["error"]["param"] == "model"
    bad = _admin(base_url, "POST", "/sleep", model="nap-a", level=3)
    assert bad.status_code == 400 and "level" in bad.json()["error"]["message"]
