"""The ``/v1/responses`` pieces that need no Ray: the store's bounds (count, bytes, TTL, least
recently used first), the request translation (items -> chat messages, tools, formats, the 400s
naming fields) and the event stream of a chat stream with text and tool calls."""

from __future__ import annotations

import os
from typing import Any

import pytest

from cluster.api.api_errors import APIError
from cluster.api.responses_builder import ResponseBuilder
from cluster.api.responses_models import ResponsesRequest
from cluster.api.responses_payloads import chat_messages, chat_request, check_request, input_items
from cluster.serving.responses_store import ResponseStore, StoreLimits


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_evicts_the_least_recently_used_past_max_responses() -> None:
    store = ResponseStore(StoreLimits(max_responses=2))
    store.put("a", b"1")
    store.put("b", b"2")
    assert store.get("a") == b"1"  # "a" is now the most recently used
    store.put("c", b"3")
    assert (store.get("a"), store.get("b"), store.get("c")) == (b"1", None, b"3")


def test_store_keeps_its_bytes_under_max_bytes() -> None:
    store = ResponseStore(StoreLimits(max_bytes=10))
    store.put("a", b"x" * 6)
    store.put("b", b"y" * 6)
    assert store.get("a") is None and store.stats() == {"responses": 1, "bytes": 6}
    assert store.put("huge", b"z" * 11) is False and store.get("huge") is None
    store.put("b", b"w" * 2)  # replacing a record counts its new size only
    assert store.stats() == {"responses": 1, "bytes": 2}


def test_store_entries_expire_after_ttl() -> None:
    clock = Clock()
    store = ResponseStore(StoreLimits(ttl_s=10), clock)
    store.put("a", b"1")
    clock.now = 10.0
    assert store.get("a") == b"1"
    clock.now = 10.5
    assert store.get("a") is None and store.stats()["responses"] == 0


def test_store_delete() -> None:
    store = ResponseStore()
    store.put("a", b"1")
    assert store.delete("a") is True and store.delete("a") is False
    assert store.stats() == {"responses": 0, "bytes": 0}


def _request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_items_become_chat_messages_with_calls_joined_to_their_turn() -> None:
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "21"}]},
    ]  # fmt: skip
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": "{}"}}
             for i, n in ((1, "f"), (2, "g"))]  # fmt: skip
    assert chat_messages(items) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "21"},
    ]


def test_a_reasoning_item_is_the_reasoning_of_the_assistant_message_after_it() -> None:
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Need the weather."}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]  # fmt: skip
    assert chat_messages(items)[1] == {
        "role": "assistant", "content": None, "reasoning_content": "Need the weather.",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}],
    }  # fmt: skip


def test_reasoning_effort_is_the_chat_requests() -> None:
    chat = chat_request(_request(reasoning={"effort": "low"}), [{"role": "user", "content": "x"}])
    assert chat.reasoning_effort == "low"
    # vLLM's other values pass too ("none" turns a template's thinking off).
    none = chat_request(_request(reasoning={"effort": "none"}), [{"role": "user", "content": "x"}])
    assert none.reasoning_effort == "none"


def test_structured_outputs_pass_to_the_chat_request_unless_text_format_is_set() -> None:
    """vLLM's extension on /v1/responses too: a grammar over the output."""
    grammar = {"grammar": 'root ::= "yes" | "no"'}
    chat = chat_request(_request(structured_outputs=grammar), [{"role": "user", "content": "x"}])
    assert chat.structured_outputs.grammar == grammar["grammar"]
    both = _request(structured_outputs=grammar, text={"format": {"type": "json_object"}})
    with pytest.raises(APIError) as info:
        chat_request(both, [{"role": "user", "content": "x"}])
    assert info.value.param == "structured_outputs"


def test_chat_request_maps_tools_choice_format_and_limits() -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = _request(
        instructions="Be brief.", max_output_tokens=7, temperature=0.5, tools=[tool],
        tool_choice="auto", text={"format": {"type": "json_schema", "name": "out",
                                             "schema": schema, "strict": True}},
    )  # fmt: skip
    chat = chat_request(req, [{"role": "user", "content": "hi"}])
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5
    assert chat.tools[0].function.name == "f" and chat.tool_choice == "auto"
    assert chat.response_format.json_schema.json_schema == schema
    # A forced call writes no text: the text format is not applied then.
    named = {"type": "function", "name": "f"}
    forced_req = _request(tools=[tool], tool_choice=named, text=req.text.model_dump(by_alias=True))
    forced = chat_request(forced_req, [{"role": "user", "content": "x"}])
    assert forced.response_format is None and forced.tool_choice.function.name == "f"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input.0.content.0"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input.0.call_id"),
        ({"background": True}, "background"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"tool_choice": {"type": "web_search_preview"}, "tools": [{"type": "function",
          "name": "f"}]}, "tool_choice.type"),
        ({"input": []}, "input"),
        ({"input": None}, "input"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field(fields: dict[str, Any], param: str) -> None:
    req = _request(**fields)
    with pytest.raises(APIError) as info:
        check_request(req)
        chat_request(req, input_items(req.input))
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert info.value.message.startswith(param)


def test_stream_events_for_text_then_a_call() -> None:
    builder = ResponseBuilder(_request(), None)
    events = builder.start()
    events += builder.feed({"role": "assistant", "content": ""})  # opens nothing
    events += builder.feed({"content": "Hi"})
    events += builder.feed(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "f", "arguments": ""},
                }
            ]
        }
    )
    events += builder.feed({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})
    events += builder.finish("tool_calls", 5)  # fmt: skip
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    message, call = final["output"]
    assert message["content"][0]["text"] == "Hi" and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_9", "f", "{}")
    assert final["usage"]["output_tokens"] == 5 and final["status"] == "completed"


def test_a_stream_that_wrote_nothing_ends_with_an_empty_message() -> None:
    builder = ResponseBuilder(_request(), None)
    events = builder.finish("length", 0)
    assert events[-1]["type"] == "response.incomplete"
    (message,) = events[-1]["response"]["output"]
    assert message["content"][0]["text"] == "" and message["status"] == "incomplete"


# ---- the config: the store's bounds, ingress replicas ----


def _config(**top: Any) -> dict[str, Any]:
    from tests.cluster.conftest import load_yaml

    return {**load_yaml("tiny.yaml"), **top}


def test_store_bounds_and_ingress_replicas_come_from_the_config() -> None:
    from cluster.config import load_config

    config = load_config(_config(responses_store={"max_responses": 5, "ttl_s": 60},
                                 http_options={"port": 8000, "ingress_replicas": 2}))  # fmt: skip
    assert (config.responses_store.max_responses, config.responses_store.ttl_s) == (5, 60)
    assert config.responses_store.max_bytes == 256 << 20
    assert config.http_options.ingress_replicas == 2


@pytest.mark.parametrize(
    ("top", "path"),
    [({"responses_store": {"ttl_s": 0}}, "responses_store.ttl_s"),
     ({"responses_store": {"max_responses": 0}}, "responses_store.max_responses"),
     ({"http_options": {"ingress_replicas": 0}}, "http_options.ingress_replicas")],
)  # fmt: skip
def test_bad_store_and_ingress_settings_are_refused_by_name(top: dict[str, Any], path: str) -> None:
    from cluster.config import load_config
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        load_config(_config(**top))


def test_several_ingress_replicas_go_behind_serves_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.config import load_config
    from cluster.ops import deploy

    # Recorded, so that whatever direct_ingress sets is undone after the test.
    for name in ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_ENABLE_DIRECT_INGRESS",
                 "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT",
                 "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
                 "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT",
                 "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"):  # fmt: skip
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    two = load_config(_config(http_options={"port": 8000, "ingress_replicas": 2}))
    # Direct ingress pins one replica to the port: with two, cluster serve uses the proxy.
    assert deploy.direct_ingress(two) is None
    assert "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT" not in os.environ
    one = load_config(_config(http_options={"port": 8000, "ingress_replicas": 1}))
    assert deploy.direct_ingress(one) is not None
