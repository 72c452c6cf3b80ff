"""The Responses routes of the ingress (``cluster.serving.ingress_responses``) over scripted
server streams, through the real HTTP routes (no engine, no Ray): a forced call cut off by
``max_output_tokens`` streamed as its whole twin has it, reasoning tokens counted, vLLM's
sampling fields passed on, the engine's errors naming the Responses fields, and OpenAI's 404
for an unknown ``previous_response_id``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cluster.api.api_errors import APIError
from cluster.api.openai_api import make_openai_app
from cluster.api.replica_messages import GenerateRequest, StreamDelta, StreamStart
from cluster.serving.ingress_responses import ResponsesServicer
from engine.client.core_messages import ChoiceDelta

WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}  # fmt: skip
BODY = {"model": "m", "input": "Weather?", "max_output_tokens": 6, "tools": [WEATHER]}
NAMED = {"type": "function", "name": "get_weather"}


class _Stream:
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    async def __aiter__(self) -> Any:
        for item in self.items:
            yield item

    def cancel(self) -> None:
        pass


class _Scripted(ResponsesServicer):
    """An ingress whose server answers every request with ``items`` (or raises ``error``)."""

    def __init__(self, items: list[Any], start: StreamStart | None = None,
                 error: APIError | None = None) -> None:  # fmt: skip
        self.items, self.start, self.error = items, start or StreamStart(prompt_tokens=5), error
        self.payloads: list[GenerateRequest] = []

    async def open_stream(self, model: str, payload: GenerateRequest) -> tuple[StreamStart, Any]:
        self.payloads.append(payload)
        if self.error is not None:
            raise self.error
        return self.start, _Stream(self.items)


def _deltas(pieces: list[str], finish: str) -> list[StreamDelta]:
    """One token a piece, the last finishing with ``finish``."""
    last = len(pieces)
    return [
        StreamDelta([ChoiceDelta(0, piece, [i], None, finish if i == last else None, None, i)])
        for i, piece in enumerate(pieces, 1)
    ]


def _client(serving: _Scripted) -> TestClient:
    return TestClient(make_openai_app(serving))  # type: ignore[arg-type]


def _events(body: bytes) -> list[dict[str, Any]]:
    blocks = [b for b in body.decode().split("\n\n") if b]
    return [json.loads(b.split("\n")[1].removeprefix("data: ")) for b in blocks]


def _stream_and_whole(body: dict[str, Any], items: list[Any], start: StreamStart | None = None
                      ) -> tuple[list[dict[str, Any]], dict[str, Any], TestClient]:  # fmt: skip
    client = _client(_Scripted(items, start))
    events = _events(client.post("/v1/responses", json={**body, "stream": True}).content)
    whole = client.post("/v1/responses", json=body).json()
    return events, whole, client


def _shape(output: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each output item without its id."""
    return [(o["type"], o["status"], o.get("arguments"), o.get("content")) for o in output]


@pytest.mark.parametrize(
    ("tool_choice", "pieces"),
    [("required", ['[{"name": "get_weather", ', '"parameters": ', '{"city": "Pa']),
     (NAMED, ['{"city', '": "Pa'])],
)  # fmt: skip
def test_a_forced_call_cut_off_streams_as_the_message_its_whole_twin_is(
    tool_choice: Any, pieces: list[str]
) -> None:
    body = {**BODY, "tool_choice": tool_choice}
    events, whole, client = _stream_and_whole(body, _deltas(pieces, "length"))
    text = "".join(pieces)
    message = [
        (
            "message",
            "incomplete",
            None,
            [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        )
    ]
    assert _shape(whole["output"]) == message  # fmt: skip
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert _shape(final["output"]) == message
    assert not any(e["type"].startswith("response.function_call") for e in events)
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["message"]
    stored = client.get(f"/v1/responses/{final['id']}").json()
    assert _shape(stored["output"]) == message


@pytest.mark.parametrize(
    ("tool_choice", "pieces"),
    [("required", ['[{"name": "get_weather", ', '"parameters": ', '{"city": "Paris"}}]']),
     (NAMED, ['{"city', '": "Paris"}'])],
)  # fmt: skip
def test_a_whole_forced_call_is_still_a_function_call(tool_choice: Any, pieces: list[str]) -> None:
    events, whole, _ = _stream_and_whole({**BODY, "tool_choice": tool_choice},
                                         _deltas(pieces, "stop"))  # fmt: skip
    call = [("function_call", "completed", '{"city": "Paris"}', None)]
    assert _shape(whole["output"]) == call
    assert _shape(events[-1]["response"]["output"]) == call
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == ['{"city": "Paris"}']


def test_reasoning_tokens_are_the_tokens_inside_the_think_block() -> None:
    start = StreamStart(prompt_tokens=5, reasoning_parser="qwen3")
    items = _deltas(["<think>", "Let", " me", " see", "</think>", "Hi", "!"], "stop")
    events, whole, _ = _stream_and_whole({"model": "m", "input": "Hi"}, items, start)
    for response in (whole, events[-1]["response"]):
        assert response["usage"]["output_tokens"] == 7
        assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}


def test_reasoning_cut_off_inside_the_think_block_is_all_reasoning_tokens() -> None:
    start = StreamStart(prompt_tokens=5, reasoning_parser="qwen3")
    items = _deltas(["<think>", "Let", " me"], "length")
    events, whole, _ = _stream_and_whole({"model": "m", "input": "Hi"}, items, start)
    for response in (whole, events[-1]["response"]):
        assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}


def test_vllm_sampling_fields_reach_the_engine() -> None:
    serving = _Scripted(_deltas(["Hi"], "stop"))
    body = {"model": "m", "input": "Hi", "skip_special_tokens": False,
            "include_stop_str_in_output": True, "bad_words": ["bad"]}  # fmt: skip
    assert _client(serving).post("/v1/responses", json=body).status_code == 200
    params = serving.payloads[0].params
    assert params["skip_special_tokens"] is False
    assert params["include_stop_str_in_output"] is True
    assert params["bad_words"] == ["bad"]


def test_request_id_is_the_response_id() -> None:
    client = _client(_Scripted(_deltas(["Hi"], "stop")))
    body = {"model": "m", "input": "Hi", "request_id": "resp_custom123"}
    assert client.post("/v1/responses", json=body).json()["id"] == "resp_custom123"
    assert client.get("/v1/responses/resp_custom123").json()["id"] == "resp_custom123"


def _error(serving: _Scripted, body: dict[str, Any]) -> dict[str, Any]:
    response = _client(serving).post("/v1/responses", json=body)
    assert response.status_code == 400
    return response.json()["error"]


def test_the_engines_max_tokens_error_names_max_output_tokens_throughout() -> None:
    engine = APIError(400, "prompt (16 tokens) + max_tokens (1010) = 1026 exceeds max_model_len "
                      "(1024); max_tokens must be <= 1008", "max_tokens")  # fmt: skip
    error = _error(_Scripted([], error=engine), {"model": "m", "input": "Hi"})
    assert error["param"] == "max_output_tokens"
    assert error["message"] == (
        "prompt (16 tokens) + max_output_tokens (1010) = 1026 exceeds "
        "max_model_len (1024); max_output_tokens must be <= 1008"
    )


def test_a_prompt_too_long_names_input() -> None:
    engine = APIError(400, "the prompt has 2000 tokens; it must be shorter than max_model_len "
                      "(1024)", "prompt")  # fmt: skip
    assert _error(_Scripted([], error=engine), {"model": "m", "input": "Hi"})["param"] == "input"


def test_a_tool_choice_naming_no_tool_names_tool_choice_name() -> None:
    body = {**BODY, "tool_choice": {"type": "function", "name": "nope"}}
    error = _error(_Scripted([]), body)
    assert error["param"] == "tool_choice.name"
    assert error["message"].startswith("tool_choice.name: "), error["message"]


def test_text_format_errors_name_text_format() -> None:
    body = {"model": "m", "input": "Hi", "text": {"format": {"type": "json_schema", "name": "r"}}}
    error = _error(_Scripted([]), body)
    assert error["param"] == "text.format.schema"
    assert error["message"].startswith("text.format.schema: required")
    refused = APIError(400, "structured_outputs.json: the grammar backend refused it",
                       "structured_outputs.json")  # fmt: skip
    schema = {"type": "json_schema", "name": "r", "schema": {"not": {"type": "string"}}}
    body = {"model": "m", "input": "Hi", "text": {"format": schema}}
    error = _error(_Scripted([], error=refused), body)
    assert error["param"] == "text.format.schema"
    assert error["message"] == "text.format.schema: the grammar backend refused it"


def test_an_unknown_previous_response_id_is_openais_404() -> None:
    body = {"model": "m", "input": "Hi", "previous_response_id": "resp_gone"}
    response = _client(_Scripted([])).post("/v1/responses", json=body)
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "Previous response with id 'resp_gone' not found.",
        "type": "invalid_request_error", "param": "previous_response_id",
        "code": "previous_response_not_found"}  # fmt: skip


def test_gpt_oss_reasoning_tokens_are_its_analysis_and_call_argument_tokens() -> None:
    """As vLLM's harmony parser counts them (openai_harmony's ``StreamableParser`` on the same
    transcript): every token of an analysis or a call's message text, no header or special
    token; 4 + 5 here, a preamble and the final answer not at all."""
    start = StreamStart(prompt_tokens=5, reasoning_parser="openai_gptoss")
    pieces = ["<|channel|>", "analysis", "<|message|>", "Need", " the", " weather", ".",
              "<|end|>", "<|start|>", "assistant", "<|channel|>", "commentary", "<|message|>",
              "Checking", ".", "<|end|>", "<|start|>", "assistant", "<|channel|>", "comment",
              "ary", " to", "=", "functions", ".get", "_weather", " ", "<|constrain|>", "json",
              "<|message|>", '{"', "city", '":"', "Paris", '"}']  # fmt: skip
    body = {"model": "m", "input": "Weather?", "tools": [WEATHER]}
    events, whole, _ = _stream_and_whole(body, _deltas(pieces, "stop"), start)
    for response in (whole, events[-1]["response"]):
        assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 9}
        assert [o["type"] for o in response["output"]] == ["reasoning", "message", "function_call"]


def test_gpt_oss_reasoning_cut_off_counts_to_the_end_and_plain_output_has_none() -> None:
    start = StreamStart(prompt_tokens=5, reasoning_parser="openai_gptoss")
    cut = ["<|channel|>", "analysis", "<|message|>", "Need", " the"]
    _, whole, _ = _stream_and_whole({"model": "m", "input": "Hi"}, _deltas(cut, "length"), start)
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    plain = ["Just", " text"]
    _, whole, _ = _stream_and_whole({"model": "m", "input": "Hi"}, _deltas(plain, "stop"), start)
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}


ANALYSIS = ["<|channel|>", "analysis", "<|message|>"]
FINAL = ["<|start|>", "assistant", "<|channel|>", "final", "<|message|>"]
CALL = ["<|start|>", "assistant", "<|channel|>", "commentary to=functions.get_weather",
        "<|message|>", '{"city":', '"Paris"}']  # fmt: skip


@pytest.mark.parametrize(
    ("pieces", "kinds"),
    [
        ([*ANALYSIS, "A", "<|end|>", *FINAL, "B", "<|end|>", "<|start|>", "assistant",
          "<|channel|>", "analysis", "<|message|>", "C"], ["reasoning", "message", "reasoning"]),
        ([*ANALYSIS, "A", "<|end|>", *CALL], ["reasoning", "function_call"]),
        ([*ANALYSIS, "A", "<|end|>", "<|start|>", "assistant", "<|channel|>", "commentary",
          "<|message|>", "Let me check.", "<|end|>", "<|start|>", "assistant", *ANALYSIS, "B",
          "<|end|>", *CALL], ["reasoning", "message", "reasoning", "function_call"]),
    ],
)  # fmt: skip
def test_gpt_oss_whole_output_is_its_messages_in_order_as_streamed(
    pieces: list[str], kinds: list[str]
) -> None:
    """vLLM's harmony path: an output item per harmony message, in their order, whole or
    streamed (a whole response once merged all reasoning into one item before the rest)."""
    start = StreamStart(prompt_tokens=5, reasoning_parser="openai_gptoss")
    body = {"model": "m", "input": "Weather?", "tools": [WEATHER]}
    events, whole, _ = _stream_and_whole(body, _deltas(pieces, "stop"), start)
    streamed = events[-1]["response"]["output"]
    assert [o["type"] for o in whole["output"]] == kinds
    assert _shape(whole["output"]) == _shape(streamed)
