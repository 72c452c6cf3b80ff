"""An assistant's earlier tool calls through the server's chat and Messages routes: the
template reads each call's arguments as an object (vLLM's rendering), and an assistant
message with an empty ``tool_calls`` takes the plain path. The reference is Hugging Face's
``apply_chat_template`` on the same tokenizer with the arguments given as objects."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from cluster.api.anthropic_models import MessagesRequest
from cluster.api.anthropic_payloads import chat_request
from cluster.api.openai_models import ChatCompletionRequest
from cluster.api.openai_payloads import chat_payload
from cluster.serving.request_inputs import request_chat_prompt
from engine.builtin.catalog import resolve_model_source

# Reads a call's arguments as a mapping and refuses an empty tool_calls list (LLM.chat's test).
from tests.engine.client.test_llm_chat import CALLS_TEMPLATE as TEMPLATE

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source("builtin:tiny-llama"))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _call(arguments: Any) -> dict[str, Any]:
    return {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": arguments}}  # fmt: skip


def _hf(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_chat_history_calls_render_with_object_arguments(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [_call('{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "tool_calls": []},
        {"role": "user", "content": "Thanks"},
    ]
    request = chat_payload(ChatCompletionRequest(model="m", messages=messages, tools=[WEATHER]))
    ids = request_chat_prompt(tokenizer, request, None, None)["prompt_token_ids"]
    expected = [
        messages[0],
        {**messages[1], "tool_calls": [_call({"city": "Paris"})]},
        messages[2],
        {"role": "assistant", "content": "Sunny."},
        messages[4],
    ]
    assert ids == _hf(tokenizer, expected)
    assert "[weather city=Paris]" in tokenizer.decode(ids)


def test_messages_tool_use_history_renders_with_object_arguments(tokenizer: Any) -> None:
    request = MessagesRequest(
        model="m",
        max_tokens=8,
        tools=[{"name": "weather", "input_schema": {"type": "object"}}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "call_1", "name": "weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}]},
        ],
    )  # fmt: skip
    payload = chat_payload(chat_request(request))
    ids = request_chat_prompt(tokenizer, payload, None, None)["prompt_token_ids"]
    assert "[weather city=Paris]" in tokenizer.decode(ids)


def test_a_template_that_joins_the_arguments_to_text_gets_the_text_sent() -> None:
    """DeepSeek-V3's way: each call's arguments joined to text (``'```json\\n' + arguments``):
    they read as the JSON text the client sent, as Hugging Face renders the request as sent."""
    deepseek = AutoTokenizer.from_pretrained(resolve_model_source("builtin:tiny-llama"))
    deepseek.chat_template = (
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.tool_calls %}{% for t in m.tool_calls %}"
        "{{ '[' + t.function.name + ' ```json' + '\\n' + t.function.arguments + '```]' }}"
        "{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [_call('{"city":"Paris"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    request = chat_payload(ChatCompletionRequest(model="m", messages=messages, tools=[WEATHER]))
    ids = request_chat_prompt(deepseek, request, None, None)["prompt_token_ids"]
    assert ids == _hf(deepseek, messages)
    assert '[weather ```json\n{"city":"Paris"}```]' in deepseek.decode(ids)
