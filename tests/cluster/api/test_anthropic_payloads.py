"""A Messages API request -> the chat request (``cluster.api.anthropic_payloads``), with no
engine: roles and blocks as chat messages, tools and tool_choice as the chat's, sampling
fields by their chat names, thinking as the template's ``enable_thinking``, and 400s that name
the field as the Messages request does."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.api.anthropic_models import CountTokensRequest, MessagesRequest
from cluster.api.anthropic_payloads import chat_request, template_kwargs
from cluster.api.api_errors import APIError
from cluster.serving.ingress_messages import messages_payload

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Weather in a city", "input_schema": SCHEMA}


def _request(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    return MessagesRequest.model_validate({**body, **fields})


def _chat(**fields: Any) -> dict[str, Any]:
    return chat_request(_request(**fields)).model_dump(exclude_none=True)


def _error(**fields: Any) -> APIError:
    with pytest.raises(APIError) as info:
        chat_request(_request(**fields))
    assert info.value.status == 400
    return info.value


def test_system_string_and_text_blocks_are_the_system_message() -> None:
    assert _chat(system="Be brief.")["messages"][0] == {"role": "system", "content": "Be brief."}
    blocks = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.", "cache_control":
              {"type": "ephemeral"}}]  # fmt: skip
    # As vLLM joins system blocks: nothing between them.
    assert _chat(system=blocks)["messages"][0] == {"role": "system", "content": "Be brief."}


def test_claude_codes_billing_header_block_is_left_out_of_the_system_message() -> None:
    """Its per-request hash would make every prompt's first tokens differ (no prefix hits)."""
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=9f2"},
              {"type": "text", "text": "You are Claude Code."}]  # fmt: skip
    system = _chat(system=blocks)["messages"][0]
    assert system == {"role": "system", "content": "You are Claude Code."}
    alone = _chat(system=blocks[:1])["messages"]
    assert alone[0]["role"] == "user"  # nothing left: no system message


def test_text_blocks_of_a_turn_are_joined_one_a_line_as_vllm_joins_them() -> None:
    content = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    messages = _chat(messages=[{"role": "user", "content": content}])["messages"]
    assert messages == [{"role": "user", "content": "Hello\nworld"}]
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": content},
             {"role": "user", "content": "Go on"}]  # fmt: skip
    assert _chat(messages=turns)["messages"][1]["content"] == "Hello\nworld"


def test_a_tool_results_text_blocks_are_joined_one_a_line() -> None:
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
        {"type": "text", "text": "12 C"}, {"type": "text", "text": "sunny"}]}  # fmt: skip
    messages = _chat(messages=[{"role": "user", "content": [result]}], tools=[WEATHER])["messages"]
    assert messages == [{"role": "tool", "tool_call_id": "toolu_1", "content": "12 C\nsunny"}]


def test_a_tool_results_images_are_a_user_message_after_its_tool_message() -> None:
    """A screenshot tool's result (Claude Code, computer use): the texts stay the tool
    message, the images follow as a user message of image parts (vLLM's conversion)."""
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [
            {"type": "text", "text": "here"},
            {"type": "image", "source": png},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        ],
    }
    turn = {"role": "user", "content": [result, {"type": "text", "text": "What is it?"}]}
    messages = _chat(messages=[turn], tools=[WEATHER])["messages"]
    assert messages == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "here"},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            ],
        },
        {"role": "user", "content": "What is it?"},
    ]
    bad = {**result, "content": [{"type": "image", "source": {"type": "file"}}]}
    error = _error(messages=[{"role": "user", "content": [bad]}], tools=[WEATHER])
    assert error.param == "messages.0.content.0.content.0.source.type"


def test_tool_use_and_tool_result_blocks_are_chat_calls_and_tool_messages() -> None:
    turns = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [{"type": "text", "text": "timed out"}]},
            {"type": "text", "text": "And Rome?"},
        ]},
    ]  # fmt: skip
    messages = _chat(messages=turns, tools=[WEATHER])["messages"]
    assert messages[1:] == [
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: timed out"},
        {"role": "user", "content": "And Rome?"},
    ]  # fmt: skip


def test_a_final_assistant_message_is_a_prefill_the_reply_continues() -> None:
    opening = [{"type": "text", "text": "The answer is"}]
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": opening}]
    chat = _chat(messages=turns)
    assert chat["continue_final_message"] is True
    assert chat["messages"][-1] == {"role": "assistant", "content": "The answer is"}
    assert _chat()["continue_final_message"] is False
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    error = _error(messages=[turns[0], {"role": "assistant", "content": [call]}], tools=[WEATHER])
    assert error.param == "messages.1"


def test_tools_are_chat_function_tools() -> None:
    function = {"name": "get_weather", "description": "Weather in a city", "parameters": SCHEMA}
    assert _chat(tools=[WEATHER])["tools"] == [{"type": "function", "function": function}]


def test_an_input_schema_without_a_type_is_an_objects() -> None:
    untyped = {k: v for k, v in SCHEMA.items() if k != "type"}
    (tool,) = _chat(tools=[{**WEATHER, "input_schema": untyped}])["tools"]
    # As vLLM adds it: last, so the template renders the same JSON.
    assert list(tool["function"]["parameters"].items()) == [*untyped.items(), ("type", "object")]


@pytest.mark.parametrize(
    ("choice", "chat_choice"),
    [({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
     ({"type": "tool", "name": "get_weather"},
      {"type": "function", "function": {"name": "get_weather"}})],
)  # fmt: skip
def test_tool_choice_is_the_chat_tool_choice(choice: dict[str, Any], chat_choice: Any) -> None:
    chat = _chat(tools=[WEATHER], tool_choice=choice)
    assert chat["tool_choice"] == chat_choice and chat["parallel_tool_calls"] is True


def test_disable_parallel_tool_use_is_no_parallel_tool_calls() -> None:
    chat = _chat(tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert chat["parallel_tool_calls"] is False


def test_sampling_fields_keep_or_take_the_chat_names() -> None:
    chat = _chat(temperature=0.5, top_p=0.9, top_k=5, stop_sequences=["END"], seed=3,
                 metadata={"user_id": "u"}, service_tier="auto", stream=True)  # fmt: skip
    assert chat["max_tokens"] == 8 and chat["stop"] == ["END"] and chat["stream"] is True
    assert (chat["temperature"], chat["top_p"], chat["top_k"], chat["seed"]) == (0.5, 0.9, 5, 3)


def test_thinking_is_the_templates_enable_thinking() -> None:
    enabled = _request(thinking={"type": "enabled", "budget_tokens": 2048}, max_tokens=4096)
    assert template_kwargs(enabled) == {"enable_thinking": True}
    payload, _ = messages_payload(enabled)
    assert payload.chat_template_kwargs == {"enable_thinking": True}
    assert template_kwargs(_request(thinking={"type": "disabled"})) == {"enable_thinking": False}
    # The request's own chat_template_kwargs win over thinking's, as in vLLM.
    own = _request(thinking={"type": "disabled"}, chat_template_kwargs={"enable_thinking": True})
    assert messages_payload(own)[0].chat_template_kwargs == {"enable_thinking": True}
    assert (
        template_kwargs(_request()) is None
        and messages_payload(_request())[0].chat_template_kwargs is None
    )


def test_a_forced_tool_becomes_the_grammar_of_the_payload() -> None:
    payload, chat = messages_payload(
        _request(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    )
    assert chat.tool_choice is not None and payload.tool_choice == "named"
    assert "json" in payload.params["structured_outputs"]


def test_count_tokens_needs_no_max_tokens_but_a_message_does() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER]}
    assert chat_request(CountTokensRequest.model_validate(body)).max_tokens is None
    with pytest.raises(ValidationError) as info:
        MessagesRequest.model_validate(body)
    assert info.value.errors()[0]["loc"] == ("max_tokens",)


def test_image_blocks_are_chat_image_parts() -> None:
    inline = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": "iVBOR"}}  # fmt: skip
    linked = {"type": "image", "source": {"type": "url", "url": "https://img.example/a.png"}}
    content = [{"type": "text", "text": "Compare"}, inline, linked]
    (message,) = _chat(messages=[{"role": "user", "content": content}])["messages"]
    assert message == {"role": "user", "content": [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
        {"type": "image_url", "image_url": {"url": "https://img.example/a.png"}}]}  # fmt: skip


def test_an_image_block_with_another_source_is_a_400_naming_it() -> None:
    image = {"type": "image", "source": {"type": "file", "file_id": "f"}}
    error = _error(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, image]}])
    assert error.param == "messages.0.content.1.source.type" and "'base64' or 'url'" in str(error)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"tools": [{**WEATHER, "type": "web_search_20250305"}]}, "tools.0.type"),
     ({"tools": [{"name": "get_weather"}]}, "tools.0.input_schema"),
     ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
      "messages.0.content.0.text"),
     ({"system": [{"type": "text", "text": ""}]}, "system.0.text"),
     ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
     ({"tool_choice": {"type": "any"}}, "tool_choice"),
     ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
     ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools.0.name"),
     ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": 1}]}]},
      "messages.0.content.0.id"),
     ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
      "messages.0.content.0.tool_use_id")],
)  # fmt: skip
def test_bad_fields_are_400s_naming_them(fields: dict[str, Any], param: str) -> None:
    assert _error(**fields).param == param


def test_a_thinking_budget_under_1024_is_a_400_naming_it() -> None:
    error = _error(thinking={"type": "enabled", "budget_tokens": 100})
    assert str(error) == "thinking.budget_tokens: must be >= 1024, got 100"


def test_a_server_tool_is_a_400_saying_it_is_not_supported() -> None:
    error = _error(tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert error.param == "tools.0.type" and "server tool 'web_search_20250305'" in str(error)


def test_a_thinking_budget_of_max_tokens_or_more_is_a_400_naming_it() -> None:
    error = _error(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=1024)
    assert str(error) == "thinking.budget_tokens: must be less than max_tokens (1024), got 1024"
    assert chat_request(_request(thinking={"type": "enabled", "budget_tokens": 1024},
                                 max_tokens=1025)).max_tokens == 1025  # fmt: skip


@pytest.mark.parametrize("temperature", [1.5, -0.5])
def test_a_temperature_outside_anthropics_range_is_a_400_naming_it(temperature: float) -> None:
    error = _error(temperature=temperature)
    assert error.param == "temperature" and "must be in [0, 1]" in str(error)
    assert _chat(temperature=1.0)["temperature"] == 1.0


def test_null_stream_is_not_given() -> None:
    assert _request(stream=None).stream is False


JSON_OUT = {"type": "json_schema", "schema": {"type": "object", "properties": {
    "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}  # fmt: skip


@pytest.mark.parametrize("fields", [{"output_config": {"format": JSON_OUT}},
                                    {"output_format": JSON_OUT}])  # fmt: skip
def test_an_output_format_constrains_the_reply_as_the_chats_json_schema(
    fields: dict[str, Any],
) -> None:
    payload, chat = messages_payload(_request(**fields))
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert payload.params["structured_outputs"] == {"json": json.dumps(JSON_OUT["schema"])}


def test_both_output_formats_are_a_400() -> None:
    fields = {"output_config": {"format": JSON_OUT}, "output_format": JSON_OUT}
    assert _error(**fields).param == "output_format"


@pytest.mark.parametrize(
    "fields",
    [{"output_config": {"format": JSON_OUT}, "tool_choice": {"type": "any"}},
     {"output_format": JSON_OUT, "tool_choice": {"type": "tool", "name": "get_weather"}}],
)  # fmt: skip
def test_a_forced_tool_calls_grammar_replaces_the_output_format(fields: dict[str, Any]) -> None:
    """As the chat route drops ``response_format`` beside a forced call (vLLM's and OpenAI's
    rule): the turn writes the call, no text for the format to shape."""
    choice = fields["tool_choice"]
    payload, _ = messages_payload(_request(tools=[WEATHER], **fields))
    forced, _ = messages_payload(_request(tools=[WEATHER], tool_choice=choice))
    assert payload.params["structured_outputs"] == forced.params["structured_outputs"]


def test_output_config_effort_is_the_templates_reasoning_effort() -> None:
    payload, _ = messages_payload(_request(output_config={"effort": "low"}))
    assert payload.chat_template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    # count_tokens renders the same prompt.
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
            "output_config": {"effort": "low"}}  # fmt: skip
    payload, _ = messages_payload(CountTokensRequest.model_validate(body))
    assert payload.chat_template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    for effort in ("xhigh", "max"):  # the anthropic client's higher levels, as vLLM takes them
        payload, _ = messages_payload(_request(output_config={"effort": effort}))
        assert payload.chat_template_kwargs == {"reasoning_effort": effort, "enable_thinking": True}


@pytest.mark.parametrize(
    ("field", "value"),
    [("chat_template", "{{ x }}"),
     ("response_format", {"type": "json_object"}), ("guided_json", {"type": "object"}),
     ("vllm_xargs", {"a": 1}), ("watermarking", True), ("n", 2)],
)  # fmt: skip
def test_undeclared_fields_that_change_the_output_are_400s_naming_them(
    field: str, value: Any
) -> None:
    error = _error(**{field: value})
    assert error.param == field and error.code == "unsupported"


def test_harmless_undeclared_fields_are_ignored() -> None:
    chat = _chat(container="c1", context_management={"edits": []}, n=1, vllm_xargs={},
                 chat_template_kwargs=None)  # fmt: skip
    assert chat["messages"] == [{"role": "user", "content": "Hi"}]


def test_a_tool_choice_naming_no_tool_is_400_naming_tool_choice_name() -> None:
    """The chat route's check names ``tool_choice.function.name``; the Messages API's field is
    ``tool_choice.name``."""
    req = _request(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(APIError) as info:
        messages_payload(req)
    assert info.value.param == "tool_choice.name"
    assert info.value.message.startswith("tool_choice.name: "), info.value.message
