"""The Messages routes of the ingress (``cluster.serving.ingress_messages``) over scripted server
streams, through the real HTTP routes (no engine, no Ray): the matched stop string named, a
server error in the middle of a stream as Anthropic's ``error`` event, a generation the replica
aborted as a 503 in Anthropic's shape, the same blocks whole and streamed, and the request
fields that reach the server's payload (or are 400s naming them)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from ray.serve.exceptions import BackPressureError

from cluster.api.openai_api import make_openai_app
from cluster.api.replica_messages import (
    GenerateRequest,
    StreamDelta,
    StreamError,
    StreamStart,
    TokenizeResult,
)
from cluster.serving.ingress_messages import MessagesServicer
from engine.client.core_messages import ChoiceDelta
from tests.cluster.serving.routed_ingress import Method, RoutedIngress

BODY = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
        "stop_sequences": ["END"]}  # fmt: skip


class _Stream:
    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.cancelled = False

    async def __aiter__(self) -> Any:
        for item in self.items:
            yield item

    def cancel(self) -> None:
        self.cancelled = True


class _Scripted(MessagesServicer):
    """An ingress whose server answers every request with ``items``."""

    def __init__(self, items: list[Any], start: StreamStart | None = None) -> None:
        self.items = items
        self.start = start or StreamStart(prompt_tokens=5)
        self.payloads: list[GenerateRequest] = []

    async def open_stream(self, model: str, payload: GenerateRequest) -> tuple[StreamStart, Any]:
        self.payloads.append(payload)
        return self.start, _Stream(self.items)


def _delta(text: str, num_tokens: int, finish: str | None = None, stop: Any = None) -> StreamDelta:
    return StreamDelta([ChoiceDelta(0, text, [num_tokens], None, finish, stop, num_tokens)])


def _client(items: list[Any], start: StreamStart | None = None) -> TestClient:
    return TestClient(make_openai_app(_Scripted(items, start)))  # type: ignore[arg-type]


def _pieces(pieces: list[str], finish: str = "stop") -> list[StreamDelta]:
    return [_delta(p, i + 1, finish if i == len(pieces) - 1 else None)
            for i, p in enumerate(pieces)]  # fmt: skip


def _streamed_message(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The message a client rebuilds from the events (as the SDK's ``get_final_message``)."""
    message = events[0][1]["message"]
    for kind, event in events[1:]:
        if kind == "content_block_start":
            message["content"].append(event["content_block"])
        elif kind == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking"}.get(delta["type"])
            if field is None:
                block["partial_json"] = block.get("partial_json", "") + delta["partial_json"]
            else:
                block[field] += delta[field]
        elif kind == "content_block_stop":
            block = message["content"][event["index"]]
            if "partial_json" in block:
                block["input"] = json.loads(block.pop("partial_json"))
        elif kind == "message_delta":
            message.update(event["delta"])
            message["usage"] = event["usage"]
    return message


def _whole_and_streamed(
    items: list[Any], start: StreamStart | None = None, **fields: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {**BODY, **fields}
    whole = _client(items, start).post("/v1/messages", json=body).json()
    streamed = _client(items, start).post("/v1/messages", json={**body, "stream": True})
    return whole, _streamed_message(_events(streamed.content))


def _same(whole: dict[str, Any], streamed: dict[str, Any]) -> None:
    def masked(message: dict[str, Any]) -> dict[str, Any]:
        content = [{k: v for k, v in b.items() if k != "id"} for b in message["content"]]
        return {**message, "id": None, "content": content}

    assert masked(whole) == masked(streamed)


def _events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in body.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            events.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_the_matched_stop_sequence_is_named() -> None:
    items = [_delta("Hello ", 1), _delta("world", 2, "stop", "END")]
    message = _client(items).post("/v1/messages", json=BODY).json()
    assert message["content"] == [{"type": "text", "text": "Hello world"}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    assert message["usage"] == {"input_tokens": 5, "output_tokens": 2}


def test_a_stop_token_is_an_end_of_turn() -> None:
    message = _client([_delta("Hi", 1, "stop", 2)]).post("/v1/messages", json=BODY).json()
    assert (message["stop_reason"], message["stop_sequence"]) == ("end_turn", None)


def test_a_server_error_mid_stream_is_an_error_event() -> None:
    failure = StreamError(503, "the replica serving 'm' failed; retry the request", None,
                          "unavailable")  # fmt: skip
    streamed = {**BODY, "stream": True}
    response = _client([_delta("Hel", 1), failure]).post("/v1/messages", json=streamed)
    events = _events(response.content)
    assert [kind for kind, _ in events] == [
        "message_start", "content_block_start", "content_block_delta", "error"]  # fmt: skip
    error = {"type": "api_error", "message": failure.message}
    assert events[-1][1] == {"type": "error", "error": error}


def test_an_aborted_generation_is_a_503_in_anthropics_shape() -> None:
    response = _client([_delta("Hel", 1, "abort")]).post("/v1/messages", json=BODY)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "api_error"
    streamed = {**BODY, "stream": True}
    response = _client([_delta("Hel", 1, "abort")]).post("/v1/messages", json=streamed)
    assert _events(response.content)[-1][0] == "error"


def test_text_around_a_think_block_keeps_its_order_whole_and_streamed() -> None:
    start = StreamStart(prompt_tokens=5, reasoning_parser="qwen3")
    items = _pieces(["Before", "<think>", "hmm", "</think>", "after"], "length")
    whole, streamed = _whole_and_streamed(items, start)
    assert whole["content"] == [{"type": "text", "text": "Before"},
                                {"type": "thinking", "thinking": "hmm", "signature": ""},
                                {"type": "text", "text": "after"}]  # fmt: skip
    _same(whole, streamed)


WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {
    "city": {"type": "string"}}}}  # fmt: skip


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_forced_call_cut_off_by_max_tokens_is_the_same_text_whole_and_streamed(
    choice: dict[str, Any],
) -> None:
    text = ['[{"name": "get_weather", ', '"parameters": {"city": "Os']
    if choice["type"] == "tool":
        text = ['{"city": ', '"Os']
    whole, streamed = _whole_and_streamed(_pieces(text, "length"), tools=[WEATHER],
                                          tool_choice=choice)  # fmt: skip
    assert whole["content"] == [{"type": "text", "text": "".join(text)}]
    assert whole["stop_reason"] == "max_tokens"
    _same(whole, streamed)


def test_a_completed_forced_call_is_the_same_tool_use_whole_and_streamed() -> None:
    text = ['[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}]']
    whole, streamed = _whole_and_streamed(_pieces(text), tools=[WEATHER],
                                          tool_choice={"type": "any"})  # fmt: skip
    ((kind, name, city),) = [(b["type"], b["name"], b["input"]["city"]) for b in whole["content"]]
    assert (kind, name, city, whole["stop_reason"]) == ("tool_use", "get_weather", "Oslo",
                                                        "tool_use")  # fmt: skip
    _same(whole, streamed)


def test_the_message_delta_usage_repeats_input_tokens() -> None:
    response = _client(_pieces(["Hi"])).post("/v1/messages", json={**BODY, "stream": True})
    (delta,) = [event for kind, event in _events(response.content) if kind == "message_delta"]
    assert delta["usage"] == {"input_tokens": 5, "output_tokens": 1}


def test_null_stream_is_a_whole_reply() -> None:
    response = _client(_pieces(["Hi"])).post("/v1/messages", json={**BODY, "stream": None})
    assert response.status_code == 200 and response.json()["content"][0]["text"] == "Hi"


def test_output_config_format_is_the_grammar_of_the_payload() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    serving = _Scripted(_pieces(['{"ok": true}']))
    body = {**BODY, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    response = TestClient(make_openai_app(serving)).post("/v1/messages", json=body)  # type: ignore[arg-type]
    assert response.status_code == 200
    assert serving.payloads[0].params["structured_outputs"] == {"json": json.dumps(schema)}


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
     ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
     ({"output_format": {"type": "json_schema", "schema": "x"}}, "output_format.schema"),
     ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
     ({"stream": "yes"}, "stream"), ({"temperature": 1.5}, "temperature")],
)  # fmt: skip
def test_bad_fields_are_400s_naming_them(fields: dict[str, Any], param: str) -> None:
    response = _client(_pieces(["Hi"])).post("/v1/messages", json={**BODY, **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(f"{param}:")


class _Tokenizer:
    """Model ``m``'s server: every prompt is 7 tokens."""

    def __init__(self, calls: list[Any]) -> None:
        self.tokenize = Method(lambda payload: TokenizeResult([1] * 7, 7, 1024), calls)

    def options(self, multiplexed_model_id: str) -> _Tokenizer:
        return self


class _Counting(RoutedIngress, MessagesServicer):
    def __init__(self) -> None:
        super().__init__(_Tokenizer)

    async def _with_image_data(self, payload: GenerateRequest) -> GenerateRequest:
        return payload


@pytest.mark.parametrize(("model", "adapter"), [("m", None), ("m:a1", "a1")])
def test_count_tokens_names_the_adapter_to_its_server(model: str, adapter: str | None) -> None:
    """The server counts an adapter's prompt (and 404s an adapter it lacks) only if told it."""
    ingress = _Counting()
    client = TestClient(make_openai_app(ingress))  # type: ignore[arg-type]
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
    response = client.post("/v1/messages/count_tokens", json=body)
    assert response.status_code == 200, response.text
    assert response.json() == {"input_tokens": 7}
    assert [p.adapter for p in ingress.calls] == [adapter]


def test_count_tokens_on_a_full_queue_is_an_overloaded_error_not_a_500() -> None:
    """Serve's ``BackPressureError`` is not a ``RayError``: it was a 500 ``api_error``."""

    def full(payload: Any) -> Any:
        raise BackPressureError(num_queued_requests=1, max_queued_requests=1)

    ingress = _Counting()
    ingress.servers["m"].tokenize = Method(full, [])
    client = TestClient(make_openai_app(ingress))  # type: ignore[arg-type]
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    response = client.post("/v1/messages/count_tokens", json=body)
    assert response.status_code == 529, response.text
    assert response.json()["error"]["type"] == "overloaded_error"
