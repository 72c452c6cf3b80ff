"""Prefill/decode disaggregation through ``cluster serve``'s application on a local Ray: one
app with the tiny Llama three times, colocated (the reference) and disaggregated (one prefill
and one decode replica, the node's KV store between them; and again with the prefill pool at
TP 2, the decode pool at TP 1), all with the same LoRA adapter. With the
official ``openai`` client, every request's greedy tokens on the disaggregated model equal the
colocated one's (chat streamed and not, completions with n = 2 and logprobs, a JSON schema, the
adapter), and the decode pool loaded the prompts' blocks that prefill computed (its external
prefix-cache hits). Faults: the prefill replica killed while prompts are on it, and prefills
that time out while Serve replaces it — every request still completes with the same tokens
(decode computes what it does not find), and neither pool holds a request or a block after."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from openai import OpenAI

from cluster.serving.serve import deployment_name
from engine.builtin.catalog import make_tiny_lora
from tests.cluster.conftest import ServeCluster, load_yaml, wait_for

APP = "disagg"
COLOCATED, PD, PD_TP2 = "colocated", "pd", "pd-tp2"
ADAPTER = "alpha"
PREFILL_TIMEOUT_S = 8.0
# Prompts of several full blocks (16 tokens each) so that most of each comes from the store.
TOPICS = ["the river", "a lighthouse keeper", "the old library", "winter markets", "a comet"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
          "count": {"type": "integer"}}, "required": ["name", "count"],
          "additionalProperties": False}  # fmt: skip


def long_prompt(topic: str) -> str:
    return f"Write a long and careful story about {topic}. " * 6


@pytest.fixture(scope="module")
def base_url(
    serve_cluster: ServeCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    from ray import serve

    adapters = tmp_path_factory.mktemp("adapters")
    make_tiny_lora("tiny-llama", adapters / ADAPTER, rank=8, target_modules=("q_proj", "v_proj"))
    store = tmp_path_factory.mktemp("kv-store")
    config = load_yaml("tiny.yaml")
    base = config["models"][0]
    base["engine_kwargs"].update({"max_model_len": 1024, "num_kv_blocks": 128, "max_loras": 1,
                                  "max_lora_rank": 8})  # fmt: skip
    lora = {"dynamic_lora_loading_path": str(adapters), "max_num_adapters_per_replica": 1}
    colocated = {**base, "model_loading_config": {"model_id": COLOCATED,
                 "model_source": "builtin:tiny-llama"}, "lora_config": lora}  # fmt: skip
    transfer = {"kv_connector": "SharedStorageConnector",
                "kv_connector_extra_config": {"shared_storage_path": str(store)}}  # fmt: skip
    pool = {"deployment_config": {"num_replicas": 1, "health_check_period_s": 2}}
    disaggregated = {
        "model_loading_config": {"model_id": PD, "model_source": "builtin:tiny-llama"},
        "engine_kwargs": {**base["engine_kwargs"], "kv_transfer_config": transfer},
        "lora_config": lora,
        "disaggregation": {
            "prefill": pool,
            "decode": pool,
            "prefill_timeout_s": PREFILL_TIMEOUT_S,
        },
    }
    models = [colocated, disaggregated, with_prefill_tp2(disaggregated, PD_TP2)]
    yield serve_cluster.deploy({**config, "models": models}, APP, f"/{APP}")
    serve.delete(APP)


def with_prefill_tp2(disaggregated: dict[str, Any], model_id: str) -> dict[str, Any]:
    """The same disaggregated model named ``model_id``, its prefill pool at TP 2 (the decode
    pool stays at TP 1: blocks re-sharded by KV head)."""
    resharded = copy.deepcopy(disaggregated)
    resharded["model_loading_config"]["model_id"] = model_id
    prefill = resharded["disaggregation"]["prefill"]
    prefill["engine_kwargs"] = {**prefill.get("engine_kwargs", {}), "tensor_parallel_size": 2}
    return resharded


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: OpenAI, model: str, topic: str, stream: bool = False, **extra: Any) -> str:
    messages = [{"role": "user", "content": long_prompt(topic)}]
    args = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0, **extra}
    if not stream:
        return client.chat.completions.create(**args).choices[0].message.content or ""
    chunks = client.chat.completions.create(**args, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def completion(client: OpenAI, model: str, topic: str) -> list[tuple[str, list[Any]]]:
    reply = client.completions.create(model=model, prompt=long_prompt(topic), max_tokens=16,
                                      temperature=0, n=2, logprobs=3)  # fmt: skip
    return [(c.text, [sorted(t.items()) for t in c.logprobs.top_logprobs]) for c in reply.choices]


def server(model: str, role: str | None = None) -> Any:
    from ray import serve

    return serve.get_deployment_handle(deployment_name(model, role), APP)


def store_hits(model: str) -> int:
    """Prompt tokens the model's (decode) replica loaded from the KV store."""
    return server(model).stats.remote().result(timeout_s=30)["external_prefix_cache_hits"]


def request_state(role: str | None) -> dict[str, Any]:
    return server(PD, role).request_state.remote().result(timeout_s=30)


def assert_idle(role: str | None) -> None:
    state = request_state(role)
    assert all(v == 0 for v in state["head"].values()) and not any(state["workers"]), state
    assert state["kv_free_blocks"] == state["kv_total_blocks"], state


def test_disaggregated_tokens_equal_colocated(client: OpenAI) -> None:
    before = store_hits(PD)
    for i, topic in enumerate(TOPICS[:3]):
        assert chat(client, PD, topic, stream=i % 2 == 1) == chat(client, COLOCATED, topic)
    assert completion(client, PD, TOPICS[3]) == completion(client, COLOCATED, TOPICS[3])
    form = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    assert chat(client, PD, TOPICS[4], response_format=form) == chat(
        client, COLOCATED, TOPICS[4], response_format=form
    )
    assert chat(client, f"{PD}:{ADAPTER}", TOPICS[0]) == chat(
        client, f"{COLOCATED}:{ADAPTER}", TOPICS[0]
    )
    # The decode pool read prompt blocks that only the prefill pool had computed: most of
    # each prompt's full blocks (7 requests of ~70-80 prompt tokens, 4 full blocks each).
    assert store_hits(PD) - before >= 7 * 3 * 16
    assert store_hits(COLOCATED) == 0
    wait_for(lambda: not any(request_state(None)["head"].values()), 30, "decode to be idle")
    assert_idle(None)
    assert_idle("prefill")


def test_a_prefill_pool_at_tp2_feeds_a_decode_pool_at_tp1(client: OpenAI) -> None:
    before = store_hits(PD_TP2)
    assert_chats_match_colocated(client, PD_TP2, TOPICS[:2])
    assert store_hits(PD_TP2) - before >= 2 * 3 * 16


def assert_chats_match_colocated(client: OpenAI, model: str, topics: list[str]) -> None:
    """A chat per topic (the second streamed) to ``model`` gives the colocated model's tokens."""
    for i, topic in enumerate(topics):
        got = chat(client, model, f"{topic}, twice", stream=i == 1)
        assert got == chat(client, COLOCATED, f"{topic}, twice")


def test_prefill_replica_killed_and_timed_out_prefills_still_complete(
    base_url: str, client: OpenAI
) -> None:
    import ray

    expected = {t: chat(client, COLOCATED, f"{t} again") for t in TOPICS}
    prefix = f"SERVE_REPLICA::{APP}#{deployment_name(PD, 'prefill')}#"
    (victim,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(prefix)]  # fmt: skip
    results: dict[str, str] = {}
    started = threading.Event()

    def run(topic: str) -> None:
        started.set()
        results[topic] = chat(client, PD, f"{topic} again")

    with ThreadPoolExecutor(len(TOPICS)) as pool:
        futures = [pool.submit(run, t) for t in TOPICS]
        started.wait(30)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        # Requests sent now meet no prefill replica until Serve has replaced it: they wait
        # prefill_timeout_s at most, then decode computes their prompts.
        late = {t: chat(client, PD, f"{t} again") for t in TOPICS[:2]}
        for future in futures:
            future.result(120)
    assert results == expected
    assert late == {t: expected[t] for t in TOPICS[:2]}
    wait_for(
        lambda: any(a["name"].startswith(prefix) and a["name"] != victim
                    for a in ray.util.list_named_actors(all_namespaces=True)),
        120, "a new prefill replica",
    )  # fmt: skip
    assert chat(client, PD, TOPICS[0]) == chat(client, COLOCATED, TOPICS[0])
    wait_for(lambda: not any(request_state(None)["head"].values()), 30, "decode to be idle")
    assert_idle(None)


pytestmark = pytest.mark.slow
