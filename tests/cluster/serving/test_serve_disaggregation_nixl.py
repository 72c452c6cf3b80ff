"""Prefill/decode disaggregation with ``NixlConnector`` through ``cluster serve``'s application on
a local Ray: the tiny Llama colocated (the reference) and disaggregated (one prefill and one
decode replica; and again with the prefill pool at TP 2, the decode pool at TP 1). The ingress
hands each prefill's ``kv_transfer_params`` to the decode request, whose engine reads the
prompt's blocks from the prefill replica's KV cache with NIXL. With the official ``openai``
client, every request's greedy tokens equal the colocated model's (chat streamed and not,
completions with n = 2 and logprobs); the decode pool read the blocks (its external
prefix-cache hits), and the prefill pool holds no block once they were read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from cluster.serving.serve import deployment_name
from tests.cluster.conftest import ServeCluster, load_yaml, wait_for
from tests.cluster.serving.test_serve_disaggregation import (
    assert_chats_match_colocated,
    chat,
    completion,
    with_prefill_tp2,
)

APP = "disagg-nixl"
COLOCATED, PD, PD_TP2 = "colocated", "pd-nixl", "pd-nixl-tp2"
TOPICS = ["the river", "a lighthouse keeper", "the old library", "winter markets"]


@pytest.fixture(scope="module")
def base_url(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    config = load_yaml("tiny.yaml")
    base = config["models"][0]
    base["engine_kwargs"].update({"max_model_len": 1024, "num_kv_blocks": 128})
    colocated = {**base, "model_loading_config": {"model_id": COLOCATED,
                 "model_source": "builtin:tiny-llama"}}  # fmt: skip
    pool = {"deployment_config": {"num_replicas": 1, "health_check_period_s": 2}}
    disaggregated = {
        "model_loading_config": {"model_id": PD, "model_source": "builtin:tiny-llama"},
        "engine_kwargs": {**base["engine_kwargs"],
                          "kv_transfer_config": {"kv_connector": "NixlConnector"}},
        "disaggregation": {"prefill": pool, "decode": pool, "prefill_timeout_s": 30},
    }  # fmt: skip
    # The prefill pool at TP 2, the decode pool at TP 1: each decode worker reads each KV head
    # from the prefill rank holding it.
    models = [colocated, disaggregated, with_prefill_tp2(disaggregated, PD_TP2)]
    yield serve_cluster.deploy({**config, "models": models}, APP, f"/{APP}")
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def server(model: str, role: str | None = None) -> Any:
    from ray import serve

    return serve.get_deployment_handle(deployment_name(model, role), APP)


def read_tokens(model: str) -> int:
    """Prompt tokens the model's decode replica read from its prefill replica."""
    return server(model).stats.remote().result(timeout_s=30)["external_prefix_cache_hits"]


def idle(model: str, role: str | None) -> bool:
    state = server(model, role).request_state.remote().result(timeout_s=30)
    quiet = all(v == 0 for v in state["head"].values()) and not any(state["workers"])
    return quiet and state["kv_free_blocks"] == state["kv_total_blocks"]


def test_nixl_disaggregated_tokens_equal_colocated(client: OpenAI) -> None:
    before = read_tokens(PD)
    for i, topic in enumerate(TOPICS[:3]):
        assert chat(client, PD, topic, stream=i % 2 == 1) == chat(client, COLOCATED, topic)
    assert completion(client, PD, TOPICS[3]) == completion(client, COLOCATED, TOPICS[3])
    # Each prompt's full blocks (~70-80 prompt tokens: 4 blocks) came from the prefill replica.
    assert read_tokens(PD) - before >= 4 * 3 * 16
    assert read_tokens(COLOCATED) == 0
    # The prefill replica freed every block once the decode side had read it.
    wait_for(lambda: idle(PD, "prefill"), 30, "prefill to release its blocks")
    wait_for(lambda: idle(PD, None), 30, "decode to be idle")


def test_a_nixl_prefill_pool_at_tp2_feeds_a_decode_pool_at_tp1(client: OpenAI) -> None:
    before = read_tokens(PD_TP2)
    assert_chats_match_colocated(client, PD_TP2, TOPICS[:2])
    assert read_tokens(PD_TP2) - before >= 2 * 4 * 16
    wait_for(lambda: idle(PD_TP2, "prefill"), 30, "prefill to release its blocks")


pytestmark = [pytest.mark.slow, pytest.mark.nixl]
