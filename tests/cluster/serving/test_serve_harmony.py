"""gpt-oss's harmony format served end to end: ``builtin:tiny-gpt-oss`` (``GptOssForCausalLM``,
so ``reasoning_parser: openai_gptoss`` and ``tool_call_parser: openai`` by default) on a local
Ray, through the official ``openai`` client, on the chat and Responses routes.

The model has random weights, so it is made to write a harmony transcript with the project's
structured outputs: an xgrammar EBNF grammar (vLLM's ``structured_outputs.grammar``) whose
``Token(id)`` elements are the harmony special tokens (``<|channel|>``, ``<|message|>``, ...,
single special tokens the grammar can only name by id) and whose text parts are the channel
names, a reasoning of letters and a call of ``get_weather`` with a city (or a final answer);
greedy, so the transcript is fixed. A grammar cannot name the stop token that ends it (the
engine's stop tokens end a complete grammar), so ``logit_bias`` picks ``<|call|>`` (or
``<|return|>``) among them. ``logit_bias`` alone (as the reasoning tests use it) cannot write
channel names and JSON; a regex over text would not produce the special tokens.

The reference is the model's own text for the same prompt tokens through ``/v1/completions``
(which no parser touches) with ``skip_special_tokens: false``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from engine.builtin.catalog import resolve_model_source
from tests.cluster.api.test_harmony import QUESTION, SPECIAL, TOOLS, harmony_params
from tests.cluster.conftest import ServeCluster

APP = "harmony"
MODEL = "gpt-oss"
SOURCE = "builtin:tiny-gpt-oss"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster) -> Iterator[OpenAI]:
    from ray import serve

    from cluster.serving.responses_store import remove_store

    model = {
        "model_loading_config": {"model_id": MODEL, "model_source": SOURCE},
        "engine_kwargs": {"device": "cpu", "dtype": "float32", "max_model_len": 1024,
                          "num_kv_blocks": 64, "enable_auto_tool_choice": True},
        "deployment_config": {"num_replicas": 1},
    }  # fmt: skip
    url = serve_cluster.deploy({"models": [model]}, APP, f"/{APP}")
    yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    serve.delete(APP)
    remove_store(APP)


def _forced(answer: str) -> dict[str, Any]:
    """The chat create() arguments that make the model write ``answer`` (see the module doc)."""
    params = harmony_params(answer)
    bias = {str(token): value for token, value in params["logit_bias"].items()}
    return {"temperature": 0, "max_tokens": params["max_tokens"], "logit_bias": bias,
            "extra_body": {"structured_outputs": params["structured_outputs"]}}  # fmt: skip


def _reference(client: OpenAI, answer: str) -> tuple[str, str]:
    """The model's raw transcript for the chat prompt and its (reasoning, rest after the
    second header's ``<|message|>``), split by hand."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(SOURCE))
    ids = tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True,
                                        return_dict=False)  # fmt: skip
    forced = _forced(answer)
    raw = client.completions.create(
        model=MODEL, prompt=ids, temperature=0, max_tokens=forced["max_tokens"],
        logit_bias=forced["logit_bias"],
        extra_body={**forced["extra_body"], "skip_special_tokens": False},
    ).choices[0].text  # fmt: skip
    assert raw.startswith("<|channel|>analysis<|message|>"), raw
    reasoning = raw.split("<|message|>")[1].split("<|end|>")[0]
    return reasoning, raw.rsplit("<|message|>", 1)[1]


def test_chat_call_is_reasoning_and_tool_calls(client: OpenAI) -> None:
    reasoning, arguments = _reference(client, "call")
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, **_forced("call")
    )
    assert "<|" not in response.model_dump_json()  # no channel syntax anywhere
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == reasoning
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == arguments
    assert list(json.loads(call.function.arguments)) == ["city"]


def test_chat_final_answer_is_reasoning_and_content(client: OpenAI) -> None:
    reasoning, content = _reference(client, "final")
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, **_forced("final")
    )
    assert "<|" not in response.model_dump_json()
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert (choice.message.reasoning_content, choice.message.content) == (reasoning, content)


def test_streamed_chat_call(client: OpenAI) -> None:
    reasoning, arguments = _reference(client, "call")
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, stream=True, **_forced("call")
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any("<|" in c.model_dump_json() for c in chunks)
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert [t.function.name for t in calls if t.id] == ["get_weather"]
    assert "".join(t.function.arguments or "" for t in calls) == arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_reasoning_item_and_function_call(client: OpenAI) -> None:
    reasoning, arguments = _reference(client, "call")
    params = harmony_params("call")
    tool = {"type": "function", **TOOLS[0]["function"]}
    response = client.responses.create(
        model=MODEL, input=QUESTION[0]["content"], tools=[tool], temperature=0,
        max_output_tokens=params["max_tokens"],
        extra_body={"structured_outputs": params["structured_outputs"],
                    "logit_bias": {str(SPECIAL["call"]): 100.0}},
    )  # fmt: skip
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    thought, call = response.output
    assert [part.text for part in thought.content] == [reasoning]
    assert (call.name, call.arguments) == ("get_weather", arguments)
    # Streamed: the same items, as events.
    events = list(client.responses.create(
        model=MODEL, input=QUESTION[0]["content"], tools=[tool], temperature=0, stream=True,
        max_output_tokens=params["max_tokens"],
        extra_body={"structured_outputs": params["structured_outputs"],
                    "logit_bias": {str(SPECIAL["call"]): 100.0}},
    ))  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    streamed = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert (text, streamed) == (reasoning, arguments)
    assert events[-1].type == "response.completed"
