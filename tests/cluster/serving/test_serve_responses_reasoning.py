"""Reasoning items in the Responses API: ``builtin:tiny-qwen3-reasoning`` served with a
``reasoning_parser`` (greedy, with ``logit_bias`` on the think tags so that it writes them:
see ``tests/cluster/serving/test_serve_reasoning.py``, whose reference split of the model's own
text this reuses). A think block is a ``reasoning`` output item (its text in ``content``), the
answer a ``message``; streamed, the reasoning arrives as ``response.reasoning_text.delta``
events, items in the order the model wrote them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from tests.cluster.conftest import ServeCluster
from tests.cluster.serving.test_serve_reasoning import (
    QUESTION,
    QWEN3,
    QWEN3_BIAS,
    R1,
    R1_BIAS,
    SOURCE,
    _raw,
    _split,
)

APP = "responses-reasoning"
MAX_TOKENS = 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster) -> Iterator[OpenAI]:
    from ray import serve

    from cluster.serving.responses_store import remove_store

    def model(model_id: str, parser: str) -> dict[str, Any]:
        return {
            "model_loading_config": {"model_id": model_id, "model_source": SOURCE},
            "engine_kwargs": {"device": "cpu", "dtype": "float32", "max_model_len": 1024,
                              "num_kv_blocks": 64, "reasoning_parser": parser},
            "deployment_config": {"num_replicas": 1},
        }  # fmt: skip

    config = {"models": [model(QWEN3, "qwen3"), model(R1, "deepseek_r1")]}
    url = serve_cluster.deploy(config, APP, f"/{APP}")
    yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    serve.delete(APP)
    remove_store(APP)


def _greedy(model: str) -> dict[str, Any]:
    bias = QWEN3_BIAS if model == QWEN3 else R1_BIAS
    return {"temperature": 0, "max_output_tokens": MAX_TOKENS, "extra_body": {"logit_bias": bias}}


def _reference(client: OpenAI, model: str) -> tuple[str, str]:
    bias = QWEN3_BIAS if model == QWEN3 else R1_BIAS
    raw = _raw(client, model, temperature=0, max_tokens=MAX_TOKENS, logit_bias=bias)
    return _split(model, raw)


@pytest.mark.parametrize("model", [QWEN3, R1])
def test_reasoning_item_then_message(client: OpenAI, model: str) -> None:
    reasoning, content = _reference(client, model)
    assert reasoning and content  # as measured: both parts are there
    response = client.responses.create(model=model, input=QUESTION, **_greedy(model))
    thought, message = response.output
    assert thought.type == "reasoning" and thought.id.startswith("rs_")
    assert [part.text for part in thought.content] == [reasoning] and thought.summary == []
    assert message.type == "message" and response.output_text == content
    assert response.usage.output_tokens == MAX_TOKENS


@pytest.mark.parametrize("model", [QWEN3, R1])
def test_streamed_reasoning_text_events(client: OpenAI, model: str) -> None:
    reasoning, content = _reference(client, model)
    events = list(client.responses.create(model=model, input=QUESTION, stream=True,
                                          **_greedy(model)))  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (streamed, text) == (reasoning, content)
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    # qwen3's model writes some answer before its think block (as measured): items follow it.
    assert added == (["message", "reasoning", "message"] if model == QWEN3 else
                     ["reasoning", "message"])  # fmt: skip
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert [e.text for e in done] == [reasoning]
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == content
