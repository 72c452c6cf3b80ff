"""The Messages routes of the ingress (``cluster.serving.ingress_messages``) over scripted server
streams, through the real HTTP routes (no engine, no Ray): the matched stop string named, a
server error in the middle of a stream as Anthropic's ``error`` event, a generation the replica
aborted as a 503 in Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient

from cluster.api.openai_api import make_openai_app
from cluster.api.replica_messages import GenerateRequest, StreamDelta, StreamError, StreamStart
from cluster.serving.ingress_messages import MessagesServicer
from engine.client.core_messages import ChoiceDelta

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

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.payloads: list[GenerateRequest] = []

    async def open_stream(self, model: str, payload: GenerateRequest) -> tuple[StreamStart, Any]:
        self.payloads.append(payload)
        return StreamStart(prompt_tokens=5), _Stream(self.items)


def _delta(text: str, num_tokens: int, finish: str | None = None, stop: Any = None) -> StreamDelta:
    return StreamDelta([ChoiceDelta(0, text, [num_tokens], None, finish, stop, num_tokens)])


def _client(items: list[Any]) -> TestClient:
    return TestClient(make_openai_app(_Scripted(items)))  # type: ignore[arg-type]


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
