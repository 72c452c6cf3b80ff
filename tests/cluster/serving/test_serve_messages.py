"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) against
configs/tiny.yaml on a local Ray, behind an API key and a route prefix, with the official
``anthropic`` SDK (its own types and stream helper throughout):

- text: ``system`` as a string and as text blocks, and a turn's text blocks, rendered as the
  chat prompt vLLM renders (input tokens equal ``/tokenize``'s); ``max_tokens`` and stop
  sequences (the matched one named); the streamed events in Anthropic's order, accumulating to
  the greedy whole message; ``output_config.format`` constrains the text as the chat route's
  ``response_format``;
- tools: a forced call (``tool_choice`` tool, any) is a ``tool_use`` block with parsed input,
  streamed as ``input_json_delta``; cut off by ``max_tokens``, the chat route's text, whole and
  streamed; the call and its ``tool_result`` sent back render as the chat template's tool
  messages;
- ``count_tokens``: the chat template's count, tools included, and a create call's input tokens;
- errors in Anthropic's shape: 404 unknown model, 400 naming the field, 401 a wrong key;
- thinking: ``builtin:tiny-qwen3-reasoning`` with the qwen3 reasoning parser (see
  ``test_serve_reasoning.py``): its think block is a ``thinking`` block."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest
from anthropic import Anthropic
from anthropic.types import Message
from openai import OpenAI
from transformers import AutoTokenizer

from engine.builtin.catalog import resolve_model_source
from tests.cluster.conftest import ServeCluster, load_yaml, prompt_tokens
from tests.cluster.serving.test_serve_reasoning import (
    QUESTION,
    QWEN3,
    QWEN3_BIAS,
    SOURCE,
    _raw,
    _split,
)
from tests.cluster.serving.test_serve_responses import WEATHER_PARAMETERS

APP = "messages"
MODEL = "tiny-llama"
KEY = "sk-messages-test"
AUTH = {"x-api-key": KEY}
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": WEATHER_PARAMETERS}  # fmt: skip
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather",
                "description": "Weather in a city", "parameters": WEATHER_PARAMETERS}}  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Oslo?"}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_url(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    config = load_yaml("tiny.yaml")
    config["models"][0]["engine_kwargs"].update(max_model_len=2048, num_kv_blocks=512)
    config["models"].append({
        "model_loading_config": {"model_id": QWEN3, "model_source": SOURCE},
        "engine_kwargs": {"device": "cpu", "dtype": "float32", "max_model_len": 1024,
                          "num_kv_blocks": 64, "reasoning_parser": "qwen3"},
        "deployment_config": {"num_replicas": 1},
    })  # fmt: skip
    yield serve_cluster.deploy(config, APP, f"/{APP}", api_keys=KEY)
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url: str) -> Anthropic:
    return Anthropic(base_url=base_url, api_key=KEY, max_retries=0)


def chat_ids(messages: list[dict[str, Any]], tools: Any = None, prefill: bool = False) -> list:
    """The chat template's prompt ids for ``messages`` with ``tools`` (the model's own
    tokenizer: /tokenize takes no tools); ``prefill``: the last message left open."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source("builtin:tiny-llama"))
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=not prefill,
                                         continue_final_message=prefill, tokenize=True,
                                         return_dict=False)  # fmt: skip


def _text(message: Message) -> str:
    (block,) = message.content
    assert block.type == "text"
    return block.text


def _blocks(message: Message) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text)  # type: ignore[union-attr]
            for b in message.content]  # fmt: skip


# ---- text ----


def test_text_with_a_string_system_is_the_chat_prompt(client: Anthropic, base_url: str) -> None:
    message = client.messages.create(
        model=MODEL, max_tokens=6, system="Answer briefly.",
        messages=[{"role": "user", "content": "Hello there"}], **GREEDY,
    )  # fmt: skip
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert _text(message)  # random weights run to the token limit
    chat = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hello there"}]  # fmt: skip
    assert message.usage.input_tokens == prompt_tokens(base_url, chat, headers=AUTH)
    assert message.usage.output_tokens == 6


def test_text_blocks_are_joined_as_vllm_joins_them(client: Anthropic, base_url: str) -> None:
    # System blocks with nothing between them, a turn's text blocks one a line.
    message = client.messages.create(
        model=MODEL, max_tokens=2,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                               {"type": "text", "text": "world"}]}],
        system=[{"type": "text", "text": "Answer "}, {"type": "text", "text": "briefly."}],
    )  # fmt: skip
    chat = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hello\nworld"}]  # fmt: skip
    assert message.usage.input_tokens == prompt_tokens(base_url, chat, headers=AUTH)


def test_output_config_format_constrains_the_text_as_the_chats_response_format(
    client: Anthropic, base_url: str
) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    ask: Any = [{"role": "user", "content": "Answer in JSON."}]
    message = client.messages.create(
        model=MODEL, max_tokens=40, messages=ask,
        extra_body={"temperature": 0,
                    "output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )  # fmt: skip
    openai = OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    chat = openai.chat.completions.create(
        model=MODEL, max_tokens=40, messages=ask, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "output",
                                                                "schema": schema}},
    )  # fmt: skip
    assert _text(message) == chat.choices[0].message.content
    if message.stop_reason == "end_turn":
        jsonschema.validate(json.loads(_text(message)), schema)


def test_a_stop_sequence_ends_the_text_and_is_named(client: Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "Count"}]
    whole = _text(client.messages.create(model=MODEL, max_tokens=16, messages=ask, **GREEDY))
    # A stop string from inside the greedy text (ASCII letters: whole characters).
    start = next(i for i in range(1, len(whole) - 1) if whole[i : i + 2].isascii()
                 and whole[i : i + 2].isalpha())  # fmt: skip
    stop = whole[start : start + 2]
    message = client.messages.create(
        model=MODEL, max_tokens=16, messages=ask, stop_sequences=["never-written", stop], **GREEDY
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert _text(message) == whole[: whole.index(stop)]
    assert message.usage.output_tokens < 16


def test_a_final_assistant_message_is_continued(client: Anthropic, base_url: str) -> None:
    prefill = {"role": "assistant", "content": "The weather is"}
    message = client.messages.create(model=MODEL, max_tokens=6, messages=[*ASK, prefill],
                                     **GREEDY)  # type: ignore[list-item]  # fmt: skip
    ids = chat_ids([*ASK, prefill], prefill=True)
    assert message.usage.input_tokens == len(ids)
    # The reply is what the model writes after the open assistant text, without it.
    openai = OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    completion = openai.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert _text(message) == completion.choices[0].text


STREAM_EVENTS = ["message_start", "content_block_start", "content_block_delta",
                 "content_block_stop", "message_delta", "message_stop"]  # fmt: skip


def test_streamed_events_accumulate_to_the_greedy_message(client: Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "Stream it"}]
    with client.messages.stream(model=MODEL, max_tokens=8, messages=ask, **GREEDY) as stream:
        kinds = [event.type for event in stream if event.type in STREAM_EVENTS]
        final = stream.get_final_message()
    deduped = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert deduped == STREAM_EVENTS
    whole = client.messages.create(model=MODEL, max_tokens=8, messages=ask, **GREEDY)
    assert _text(final) == _text(whole)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert final.usage.input_tokens == whole.usage.input_tokens


# ---- tools ----


def _forced_call(client: Anthropic, tool_choice: Any, seed: int) -> Message:
    return client.messages.create(
        model=MODEL, max_tokens=300, messages=ASK, tools=[WEATHER],  # type: ignore[list-item]
        tool_choice=tool_choice, extra_body={"seed": seed},
    )  # fmt: skip


def test_a_named_tool_is_a_tool_use_block_with_parsed_input(client: Anthropic) -> None:
    message = _forced_call(client, {"type": "tool", "name": "get_weather"}, seed=5)
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_") and message.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER_PARAMETERS)


def test_tool_choice_any_streams_input_json_deltas(client: Anthropic) -> None:
    with client.messages.stream(
        model=MODEL, max_tokens=300, messages=ASK, tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"seed": 3},
    ) as stream:  # fmt: skip
        deltas = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        final = stream.get_final_message()
    (call,) = final.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert final.stop_reason == "tool_use"
    assert json.loads("".join(deltas)) == call.input
    jsonschema.validate(call.input, WEATHER_PARAMETERS)


def test_a_forced_call_cut_off_by_max_tokens_is_the_chat_routes_text_whole_and_streamed(
    client: Anthropic, base_url: str
) -> None:
    request: Any = {"model": MODEL, "max_tokens": 12, "messages": ASK, "tools": [WEATHER],
                    "tool_choice": {"type": "any"}, "extra_body": {"seed": 3}}  # fmt: skip
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    openai = OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    chat = openai.chat.completions.create(
        model=MODEL, max_tokens=12, messages=ASK, tools=[CHAT_WEATHER], tool_choice="required",
        seed=3,
    )  # fmt: skip
    assert chat.choices[0].finish_reason == "length"
    assert _text(whole) == _text(streamed) == chat.choices[0].message.content
    assert whole.stop_reason == streamed.stop_reason == "max_tokens"


def test_tool_use_and_tool_result_sent_back_render_as_chat_tool_messages(
    client: Anthropic,
) -> None:
    first = _forced_call(client, {"type": "tool", "name": "get_weather"}, seed=5)
    (call,) = first.content
    assert call.type == "tool_use"
    result = {"type": "tool_result", "tool_use_id": call.id, "content": '{"temp": 21}'}
    messages: Any = [*ASK, first.to_param(), {"role": "user", "content": [result]}]
    second = client.messages.create(
        model=MODEL, max_tokens=4, messages=messages, tools=[WEATHER], **GREEDY  # type: ignore[list-item]
    )  # fmt: skip
    assert second.stop_reason in ("max_tokens", "end_turn", "tool_use")
    arguments = json.dumps(call.input, ensure_ascii=False)
    chat = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]  # fmt: skip
    assert second.usage.input_tokens == len(chat_ids(chat, [CHAT_WEATHER]))


# ---- count_tokens ----


def test_count_tokens_is_the_rendered_prompt_with_tools(client: Anthropic) -> None:
    request: Any = {"model": MODEL, "messages": ASK, "system": "Be terse.", "tools": [WEATHER]}
    counted = client.messages.count_tokens(**request)
    chat = [{"role": "system", "content": "Be terse."}, *ASK]
    assert counted.input_tokens == len(chat_ids(chat, [CHAT_WEATHER]))
    created = client.messages.create(max_tokens=1, **request)
    assert created.usage.input_tokens == counted.input_tokens


# ---- errors ----


def test_unknown_model_is_not_found(client: Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", max_tokens=2, messages=ASK)  # type: ignore[arg-type]
    assert info.value.body["type"] == "error"  # type: ignore[index]
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_missing_max_tokens_is_a_bad_request_naming_it(client: Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", body={"model": MODEL, "messages": ASK}, cast_to=Message)
    error = info.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("max_tokens")


def test_an_image_from_a_host_not_allowed_is_a_bad_request_naming_it(client: Anthropic) -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=2,
                               messages=[{"role": "user", "content": [image]}])  # type: ignore[list-item]  # fmt: skip
    message = info.value.body["error"]["message"]  # type: ignore[index]
    assert message.startswith("messages.0.content.0.image_url.url: remote image URLs are not")


def test_a_wrong_key_is_an_authentication_error_and_a_bearer_token_is_a_key(
    base_url: str,
) -> None:
    wrong = Anthropic(base_url=base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model=MODEL, max_tokens=1, messages=ASK)  # type: ignore[arg-type]
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    bearer = Anthropic(base_url=base_url, api_key=None, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0  # type: ignore[arg-type]


# ---- thinking ----


def _thinking_reference(base_url: str) -> tuple[str, str, str]:
    """The text before the model's think block, the block (the reasoning), the text after."""
    openai = OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    raw = _raw(openai, QWEN3, temperature=0, max_tokens=24, logit_bias=QWEN3_BIAS)
    reasoning, _ = _split(QWEN3, raw)
    before, _, rest = raw.partition("<think>")
    return before, reasoning, rest.partition("</think>")[2]


def test_thinking_is_a_thinking_block_where_the_model_wrote_it(
    client: Anthropic, base_url: str
) -> None:
    before, reasoning, after = _thinking_reference(base_url)
    assert reasoning and after  # as measured: both parts are there
    request: Any = {"model": QWEN3, "max_tokens": 24, "thinking": {"type": "adaptive"},
                    "messages": [{"role": "user", "content": QUESTION}],
                    "extra_body": {"temperature": 0, "logit_bias": QWEN3_BIAS}}  # fmt: skip
    expected = [("text", before), ("thinking", reasoning), ("text", after)]
    expected = [(kind, text) for kind, text in expected if text]
    assert _blocks(client.messages.create(**request)) == expected
    with client.messages.stream(**request) as stream:  # the same blocks, streamed
        assert _blocks(stream.get_final_message()) == expected


def test_streamed_thinking_deltas_and_disabled_thinking(client: Anthropic, base_url: str) -> None:
    _, reasoning, _ = _thinking_reference(base_url)
    ask: Any = [{"role": "user", "content": QUESTION}]
    with client.messages.stream(
        model=QWEN3, max_tokens=24, messages=ask,
        thinking={"type": "adaptive"},
        extra_body={"temperature": 0, "logit_bias": QWEN3_BIAS},
    ) as stream:  # fmt: skip
        deltas = [
            e.delta.thinking
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
        ]
        final = stream.get_final_message()
    assert "".join(deltas) == reasoning
    assert [b.thinking for b in final.content if b.type == "thinking"] == [reasoning]
    # Disabled: the template closes an empty think block in the prompt.
    enabled = client.messages.count_tokens(
        model=QWEN3, messages=ask, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    disabled = client.messages.count_tokens(model=QWEN3, messages=ask,
                                            thinking={"type": "disabled"})  # fmt: skip
    assert disabled.input_tokens > enabled.input_tokens
