"""A chat result -> a Messages API message and its SSE events (``cluster.api.anthropic_builder``),
from scripted server streams (no engine); and Anthropic's error shape on the Messages routes
only (``cluster.api.api_errors``, through the real routes over a stub serving)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cluster.api.anthropic_builder import MessageBuilder, stop_reason
from cluster.api.api_errors import APIError, anthropic_route
from cluster.api.openai_api import make_openai_app
from cluster.api.openai_payloads import ToolChoice
from cluster.api.replica_messages import StreamStart
from cluster.api.responses_builder import sse_event
from tests.cluster.api.scripted_chat import scripted_chat

START = StreamStart(prompt_tokens=7)


@pytest.mark.parametrize(
    ("finish", "matched", "tool_used", "expected"),
    [("length", None, False, ("max_tokens", None)), ("stop", None, False, ("end_turn", None)),
     ("stop", 2, False, ("end_turn", None)), ("stop", "END", False, ("stop_sequence", "END")),
     ("stop", "</s>", False, ("end_turn", None)), ("tool_calls", None, True, ("tool_use", None)),
     ("stop", None, True, ("tool_use", None)), ("length", None, True, ("max_tokens", None))],
)  # fmt: skip
def test_stop_reason(finish: str, matched: Any, tool_used: bool, expected: tuple) -> None:
    # A stop string the request did not ask for (a model's own) is an end of turn.
    assert stop_reason(finish, matched, ["END"], tool_used) == expected


def _events(pieces: list[str], **script: Any) -> tuple[MessageBuilder, list[dict[str, Any]]]:
    """The events a streamed chat of ``pieces`` makes (stop sequences: ``END``)."""
    completion, chunks = scripted_chat(START, pieces, stream=True, **script)
    builder = MessageBuilder("m", ["END"])
    builder.input_tokens = START.prompt_tokens
    events = builder.start()
    for chunk in chunks:
        events += builder.feed(chunk["delta"])
    choice = completion.choices[0]
    events += builder.finish(choice.finish_reason, choice.stop_reason, choice.num_tokens)
    return builder, events


def test_streamed_text_events_in_anthropic_order() -> None:
    builder, events = _events(["Hel", "lo"], stop_reason="END")
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    start = events[0]["message"]
    assert start["content"] == [] and start["usage"] == {"input_tokens": 7, "output_tokens": 0}
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    assert [e["delta"] for e in events[2:4]] == [{"type": "text_delta", "text": "Hel"},
                                                 {"type": "text_delta", "text": "lo"}]  # fmt: skip
    assert all(e["index"] == 0 for e in events[1:5])
    assert events[5]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    # As Anthropic's (and vLLM's) stream: the usage repeats input_tokens.
    assert events[5]["usage"] == {"input_tokens": 7, "output_tokens": 2}
    assert builder.message()["content"] == [{"type": "text", "text": "Hello"}]


def test_a_streamed_named_call_is_a_tool_use_block_of_input_json_deltas() -> None:
    pieces = ['{"ci', 'ty": "Os', 'lo"}']
    builder, events = _events(pieces, tools=ToolChoice("named", name="get_weather"))
    kinds = [e["type"] for e in events]
    assert kinds[1] == "content_block_start" and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    block = events[1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"input_json_delta"}
    assert "".join(d["partial_json"] for d in deltas) == "".join(pieces)
    assert builder.message()["content"][0]["input"] == {"city": "Oslo"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_a_forced_call_cut_off_by_max_tokens_is_the_text_the_chat_route_returns() -> None:
    pieces = ['[{"name": "get_weather", ', '"parameters": {"ci']
    for tools in (ToolChoice("required"), ToolChoice("named", name="get_weather")):
        builder, events = _events(pieces, tools=tools, finish="length")
        chat, _ = scripted_chat(START, pieces, stream=False, tools=tools, finish="length")
        (choice,) = chat.whole()["choices"]
        assert (
            choice["message"]["content"] == "".join(pieces) and choice["finish_reason"] == "length"
        )
        message = builder.message()
        assert message["content"] == [{"type": "text", "text": "".join(pieces)}]
        assert message["stop_reason"] == "max_tokens"
        assert all(e["content_block"]["type"] == "text" for e in events
                   if e["type"] == "content_block_start")  # fmt: skip


def test_a_completed_forced_call_is_a_tool_use_block_after_the_output_ends() -> None:
    pieces = ['[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}]']
    builder, events = _events(pieces, tools=ToolChoice("required"))
    (block,) = builder.message()["content"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather",
                                                            {"city": "Oslo"})  # fmt: skip
    assert builder.message()["stop_reason"] == "tool_use"
    deltas = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert json.loads("".join(deltas)) == {"city": "Oslo"}


def test_an_auto_call_cut_off_keeps_its_raw_arguments() -> None:
    _, chunks = scripted_chat(
        StreamStart(prompt_tokens=7, tool_call_parser="hermes"),
        ['<tool_call>\n{"name": "f", "arguments": {"b": ', '"x'],
        stream=True, tools=ToolChoice("auto"), finish="length",
    )  # fmt: skip
    builder = MessageBuilder("m")
    for chunk in chunks:
        builder.feed(chunk["delta"])
    builder.finish("length", None, 2)
    (call,) = builder.message()["content"]
    # Its input is no JSON object yet: the raw text, not a parse error.
    assert (call["type"], call["name"], call["input"]) == ("tool_use", "f",
                                                         {"arguments": '{"b": "x'})  # fmt: skip
    assert builder.message()["stop_reason"] == "max_tokens"


def test_a_kind_change_closes_the_open_block() -> None:
    builder = MessageBuilder("m")
    events = builder.feed({"reasoning_content": "Think."}) + builder.feed({"content": "Say."})
    assert [e["type"] for e in events] == [
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta"]  # fmt: skip
    assert events[1]["delta"] == {"type": "thinking_delta", "thinking": "Think."}
    assert events[3]["index"] == 1 and events[3]["content_block"]["type"] == "text"


def test_sse_lines_name_the_event() -> None:
    event = MessageBuilder("m").fail(503, "overloaded now", "overloaded")[0]
    data = {"type": "error", "error": {"type": "overloaded_error", "message": "overloaded now"}}
    assert event == data
    assert (
        sse_event(event)
        == f"event: error\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
    )


# ---- error bodies: Anthropic's on /v1/messages…, OpenAI's elsewhere ----

KEY = "sk-anthropic-unit"


class _Failing:
    """A serving whose generation routes raise ``error``."""

    def __init__(self, error: APIError) -> None:
        self.error = error

    async def messages(self, req: Any) -> Any:
        raise self.error

    async def count_message_tokens(self, req: Any) -> Any:
        raise self.error

    async def chat_completions(self, req: Any) -> Any:
        raise self.error


def _client(error: APIError, keyed: bool = False) -> TestClient:
    keys = [hashlib.sha256(KEY.encode()).hexdigest()] if keyed else []
    return TestClient(make_openai_app(_Failing(error), keys, max_body_bytes=4096))  # type: ignore[arg-type]


BODY = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [(APIError(404, "no model", "model"), 404, "not_found_error"),
     (APIError(503, "queue full", None, "overloaded", retry_after=1), 529, "overloaded_error"),
     (APIError(503, "engine dead", None, "engine_dead"), 503, "api_error"),
     (APIError(408, "timed out"), 408, "timeout_error"),
     (APIError(429, "slow down"), 429, "rate_limit_error")],
)  # fmt: skip
def test_messages_errors_take_anthropics_shape(error: APIError, status: int, kind: str) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = _client(error).post(path, json=BODY)
        assert response.status_code == status
        body = {"type": "error", "error": {"type": kind, "message": error.message}}
        assert response.json() == body
    if error.retry_after is not None:
        assert response.headers["retry-after"] == str(error.retry_after)


def test_chat_errors_keep_openais_shape() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    response = _client(APIError(404, "no model", "model")).post("/v1/chat/completions", json=body)
    assert response.json()["error"]["type"] == "NotFoundError"


def test_validation_key_and_size_errors_take_anthropics_shape() -> None:
    client = _client(APIError(500, "unused"), keyed=True)
    missing = {k: v for k, v in BODY.items() if k != "max_tokens"}
    response = client.post("/v1/messages", json=missing, headers={"x-api-key": KEY})
    assert response.status_code == 400
    assert response.json()["error"] == {"type": "invalid_request_error",
                                        "message": "max_tokens: Field required"}  # fmt: skip
    response = client.post("/v1/messages", json=BODY, headers={"x-api-key": "sk-wrong"})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    big = {**BODY, "system": "x" * 5000}
    response = client.post("/v1/messages", json=big, headers={"x-api-key": KEY})
    assert response.status_code == 413 and response.json()["error"]["type"] == "request_too_large"


@pytest.mark.parametrize(
    ("path", "root", "expected"),
    [("/v1/messages", "", True), ("/v1/messages/count_tokens", "", True),
     ("/app/v1/messages", "/app", True), ("/v1/messagesx", "", False),
     ("/v1/chat/completions", "", False), ("/app/v1/chat/completions", "/app", False)],
)  # fmt: skip
def test_anthropic_route(path: str, root: str, expected: bool) -> None:
    assert anthropic_route({"path": path, "root_path": root}) is expected
