"""A reasoning model served with ``reasoning_parser`` (``qwen3``, ``deepseek_r1``) on a local Ray,
through the official ``openai`` client and ``langchain-openai``: ``builtin:tiny-qwen3-reasoning``
(random weights), made to write think tags with ``logit_bias`` on ``<think>`` and ``</think>``
(greedy, so the output is fixed). The model's own text, read through ``/v1/completions``
(which no parser touches) for the same prompt tokens, is the reference every split is checked
against."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_reasoning_models import THINK_END_ID, THINK_START_ID
from tests.cluster.conftest import ServeCluster

APP = "reasoning"
QWEN3, R1 = "reasoner-qwen3", "reasoner-r1"  # the same model, one deployment per parser
SOURCE = "builtin:tiny-qwen3-reasoning"
QUESTION = "What is two plus two?"
# Greedy with these biases the model writes " most<think>…</think>…" (measured): some content,
# a think block, more content.
QWEN3_BIAS = {str(THINK_START_ID): 6, str(THINK_END_ID): 8}
# Greedy with this bias, the model's 3rd token is </think> (measured): deepseek_r1 reads the
# first two as reasoning, and a structured output's grammar starts right after them.
R1_BIAS = {str(THINK_END_ID): 6}


class Answer(BaseModel):
    answer: int = Field(ge=0, le=99)
    sure: bool


@pytest.fixture(scope="module")
def base_url(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    def model(model_id: str, parser: str) -> dict[str, Any]:
        return {
            "model_loading_config": {"model_id": model_id, "model_source": SOURCE},
            "engine_kwargs": {
                "device": "cpu",
                "dtype": "float32",
                "max_model_len": 1024,
                "num_kv_blocks": 64,
                "reasoning_parser": parser,
            },
            "deployment_config": {"num_replicas": 1},
        }

    url = serve_cluster.deploy({"models": [model(QWEN3, "qwen3"), model(R1, "deepseek_r1")]},
                               APP, f"/{APP}")  # fmt: skip
    yield url
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _raw(client: OpenAI, model: str, **params: Any) -> str:
    """The model's unparsed text for the chat prompt: the same tokens through completions."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(SOURCE))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False)  # fmt: skip
    return client.completions.create(model=model, prompt=ids, **params).choices[0].text


def _split(model: str, raw: str) -> tuple[str, str]:
    """Each parser's split, written out: qwen3's think block is the reasoning and the rest the
    content; deepseek_r1's reasoning is everything before </think>."""
    if model == R1:
        reasoning, _, content = raw.partition("</think>")
        return reasoning, content
    before, _, rest = raw.partition("<think>")
    reasoning, _, after = rest.partition("</think>")
    return reasoning, before + after


def _greedy(model: str, max_tokens: int = 24) -> dict[str, Any]:
    bias = QWEN3_BIAS if model == QWEN3 else R1_BIAS
    return {"temperature": 0, "max_tokens": max_tokens, "logit_bias": bias}


@pytest.mark.parametrize("model", [QWEN3, R1])
def test_chat_reasoning_content(client: OpenAI, model: str) -> None:
    raw = _raw(client, model, **_greedy(model))
    assert raw.count("</think>") >= 1 and (model == R1 or "<think>" in raw)  # as measured
    reasoning, content = _split(model, raw)
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model=model, messages=messages, **_greedy(model))
    message = reply.choices[0].message
    assert message.reasoning_content == reasoning
    assert message.content == content
    assert reply.usage.completion_tokens == 24


@pytest.mark.parametrize("model", [QWEN3, R1])
def test_streamed_reasoning_content(client: OpenAI, model: str) -> None:
    reasoning, content = _split(model, _raw(client, model, **_greedy(model)))
    messages = [{"role": "user", "content": QUESTION}]
    stream = client.chat.completions.create(model=model, messages=messages, stream=True,
                                            **_greedy(model))  # fmt: skip
    got_reasoning, got_content, finish = [], [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        got_reasoning.append(getattr(delta, "reasoning_content", None) or "")
        got_content.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(got_reasoning) == reasoning
    assert "".join(got_content) == content
    assert finish == "length"


def test_structured_output_constrains_the_answer(client: OpenAI) -> None:
    """The grammar starts after </think>: the reasoning is the unconstrained model's, and the
    content after it is the schema's (parsed by the client into the pydantic model)."""
    reasoning = _split(R1, _raw(client, R1, **_greedy(R1)))[0]
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.parse(model=R1, messages=messages, response_format=Answer,
                                          **_greedy(R1, 80))  # fmt: skip
    message = reply.choices[0].message
    assert message.reasoning_content == reasoning
    assert isinstance(message.parsed, Answer)
    jsonschema.validate(json.loads(message.content), Answer.model_json_schema())
    assert reply.choices[0].finish_reason == "stop"


def test_langchain_against_reasoning_deployments(base_url: str, client: OpenAI) -> None:
    from langchain_openai import ChatOpenAI

    def chat(model: str, max_tokens: int) -> ChatOpenAI:
        return ChatOpenAI(model=model, base_url=f"{base_url}/v1", api_key="unused",
                          max_retries=0, temperature=0, max_tokens=max_tokens,
                          logit_bias=_greedy(model)["logit_bias"])  # fmt: skip

    reply = chat(QWEN3, 24).invoke(QUESTION)
    assert reply.content == _split(QWEN3, _raw(client, QWEN3, **_greedy(QWEN3)))[1]
    assert reply.response_metadata["finish_reason"] == "length"
    structured = chat(R1, 80).with_structured_output(Answer, method="json_schema")
    assert isinstance(structured.invoke(QUESTION), Answer)


pytestmark = pytest.mark.slow
