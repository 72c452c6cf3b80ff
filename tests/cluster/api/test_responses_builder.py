"""The Responses builder (``cluster.api.responses_builder``) with no server: how a stream ends
(an aborted generation fails), what a response echoes, and its items in the order the model
wrote them (a whole response is the object the same events build)."""

from __future__ import annotations

from typing import Any

from cluster.api.openai_payloads import ToolChoice
from cluster.api.replica_messages import StreamStart
from cluster.api.responses_builder import ResponseBuilder
from cluster.api.responses_models import ResponsesRequest
from tests.cluster.api.scripted_chat import scripted_chat


def _builder(**fields: Any) -> ResponseBuilder:
    return ResponseBuilder(ResponsesRequest.model_validate({"model": "m", "input": "Hi", **fields}),
                           None)  # fmt: skip


def test_an_aborted_stream_ends_with_response_failed_and_its_item_incomplete() -> None:
    builder = _builder()
    builder.start()
    builder.feed({"content": "partial"})
    events = builder.finish("abort", 3)
    assert events[-1]["type"] == "response.failed"
    response = events[-1]["response"]
    assert response["status"] == "failed"
    assert response["error"]["code"] == "server_error"
    assert [item["status"] for item in response["output"]] == ["incomplete"]


def test_sampling_defaults_are_echoed_as_the_values_used() -> None:
    response = _builder().response()
    assert (response["temperature"], response["top_p"]) == (1.0, 1.0)
    response = _builder(temperature=0.5, top_p=0.9).response()
    assert (response["temperature"], response["top_p"]) == (0.5, 0.9)


def test_reasoning_is_echoed_as_sent() -> None:
    assert _builder().response()["reasoning"] is None
    assert _builder(reasoning={"effort": "low"}).response()["reasoning"] == {"effort": "low"}


def test_reasoning_cut_off_is_one_incomplete_reasoning_item() -> None:
    builder = _builder()
    builder.start()
    builder.feed({"reasoning_content": "thinking..."})
    builder.finish("length", 5)
    output = builder.response()["output"]
    assert [(o["type"], o["status"]) for o in output] == [("reasoning", "incomplete")]


def test_harmony_messages_are_items_in_the_order_written() -> None:
    """gpt-oss: analysis, a commentary preamble, analysis again, a call: four items, not one
    reasoning item with both analyses."""
    tokens = ["<|channel|>analysis<|message|>", "A1", "<|end|>",
              "<|start|>assistant<|channel|>commentary<|message|>", "P", "<|end|>",
              "<|start|>assistant<|channel|>analysis<|message|>", "A2", "<|end|>",
              "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json",
              "<|message|>", "{}"]  # fmt: skip
    start = StreamStart(3, tool_call_parser="openai", reasoning_parser="openai_gptoss")
    completion, chunks = scripted_chat(start, tokens, stream=True, tools=ToolChoice("auto"))
    builder = _builder(tools=[{"type": "function", "name": "f", "parameters": {}}])
    builder.start()
    for chunk in chunks:
        builder.feed(chunk["delta"])
    builder.finish(completion.choices[0].finish_reason, completion.completion_tokens)
    shown = [(o["type"], o["content"][0]["text"] if o["type"] != "function_call" else o["name"])
             for o in builder.response()["output"]]  # fmt: skip
    assert shown == [("reasoning", "A1"), ("message", "P"), ("reasoning", "A2"),
                     ("function_call", "f")]  # fmt: skip
