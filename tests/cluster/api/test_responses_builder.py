"""The Responses builder (``cluster.api.responses_builder``) with no server: how a stream ends
(an aborted generation fails), what a response echoes, and whole and streamed outputs alike."""

from __future__ import annotations

from typing import Any

from cluster.api.responses_builder import ResponseBuilder
from cluster.api.responses_models import ResponsesRequest


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


def test_an_aborted_whole_response_has_its_item_incomplete() -> None:
    builder = _builder()
    builder.absorb_message({"role": "assistant", "content": "partial"}, "abort", 3)
    response = builder.response()
    assert response["status"] == "failed"
    assert [item["status"] for item in response["output"]] == ["incomplete"]


def test_sampling_defaults_are_echoed_as_the_values_used() -> None:
    response = _builder().response()
    assert (response["temperature"], response["top_p"]) == (1.0, 1.0)
    response = _builder(temperature=0.5, top_p=0.9).response()
    assert (response["temperature"], response["top_p"]) == (0.5, 0.9)
    builder = _builder(top_p=0.9)  # the replica's values: the model's defaults filled in
    builder.temperature, builder.top_p = 0.6, 0.95
    assert (builder.response()["temperature"], builder.response()["top_p"]) == (0.6, 0.9)


def test_reasoning_is_echoed_as_sent() -> None:
    assert _builder().response()["reasoning"] is None
    assert _builder(reasoning={"effort": "low"}).response()["reasoning"] == {"effort": "low"}


def test_reasoning_cut_off_is_one_reasoning_item_whole_and_streamed() -> None:
    streamed = _builder()
    streamed.start()
    streamed.feed({"reasoning_content": "thinking..."})
    streamed.finish("length", 5)
    whole = _builder()
    whole.absorb_message({"role": "assistant", "content": None,
                          "reasoning_content": "thinking..."}, "length", 5)  # fmt: skip
    for builder in (streamed, whole):
        output = builder.response()["output"]
        assert [(o["type"], o["status"]) for o in output] == [("reasoning", "incomplete")]
