"""The OpenAI Responses API (``/v1/responses``) against configs/tiny.yaml on a local Ray, with
the official ``openai`` client and the OpenAI Agents SDK, through two ingress replicas:

- text and item input, rendered exactly as the equivalent chat messages (prompt token counts
  equal ``/tokenize``'s); a function call round trip; ``text.format`` with a pydantic model
  (``responses.parse``); streamed events in OpenAI's order with consecutive sequence numbers,
  through ``responses.stream`` too;
- ``previous_response_id`` continued on the other ingress replica (the store is shared; the
  ingress names itself in a header); ``GET`` / ``DELETE``; ``store: false``;
- 400s naming built-in tools and non-text parts; 404 for an unknown id;
- an agent (``openai-agents``) with a function tool: a forced call, the tool run, then a
  structured final output (random weights: only forced calls and grammars make the protocol
  deterministic, so that is what is asserted)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import pytest
from openai import BadRequestError, NotFoundError, OpenAI
from pydantic import BaseModel

from cluster.serving.ingress_responses import INGRESS_REPLICA_HEADER
from tests.cluster.conftest import ServeCluster, load_yaml, prompt_tokens

APP = "responses"
MODEL = "tiny-llama"
ENGINE_KWARGS = {"max_model_len": 2048, "num_kv_blocks": 512}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]},
                   "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}  # fmt: skip
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": WEATHER_PARAMETERS, "strict": True}  # fmt: skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_url(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    from cluster.serving.responses_store import remove_store

    config = load_yaml("tiny.yaml")
    config["models"][0]["engine_kwargs"].update(ENGINE_KWARGS)
    config["http_options"]["ingress_replicas"] = 2
    url = serve_cluster.deploy(config, APP, f"/{APP}")
    yield url
    serve.delete(APP)
    remove_store(APP)


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _text(response: Any) -> str:
    (message,) = [item for item in response.output if item.type == "message"]
    return message.content[0].text


# ---- create: text, items, usage ----


def test_text_input_with_instructions_is_the_chat_prompt(client: OpenAI, base_url: str) -> None:
    response = client.responses.create(
        model=MODEL, input="Hello there", instructions="Answer briefly.", max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete"  # random weights run to the token limit
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == _text(response) and response.output_text
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Hello there"}]  # fmt: skip
    usage = response.usage
    assert usage.input_tokens == prompt_tokens(base_url, messages)
    assert usage.output_tokens == 6 and usage.total_tokens == usage.input_tokens + 6


def test_item_input_renders_every_role_and_text_part(client: OpenAI, base_url: str) -> None:
    items: list[Any] = [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                     {"type": "input_text", "text": "you"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
        {"role": "user", "content": "Again?"},
    ]  # fmt: skip
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=3, temperature=0)
    # Developer messages are the system prompt for the chat template; text parts are joined
    # by newlines, as the chat route (and vLLM) joins them.
    messages = [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Hi \nyou"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Again?"}]  # fmt: skip
    assert response.usage.input_tokens == prompt_tokens(base_url, messages)


def test_greedy_output_equals_the_chat_route(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Same prompt", max_output_tokens=8, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Same prompt"}], max_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content


# ---- tools ----


def test_function_call_round_trip(client: OpenAI, base_url: str) -> None:
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.responses.create(
        model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=300, extra_body={"seed": 3},
    )  # fmt: skip
    assert first.status == "completed", first.output
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    # The call and its output go back as items: the template renders both.
    second = client.responses.create(
        model=MODEL, tools=[WEATHER], max_output_tokens=4, temperature=0,
        input=ask + [call.model_dump(exclude_none=True),
                     {"type": "function_call_output", "call_id": call.call_id,
                      "output": '{"temp": 21}'}],
    )  # fmt: skip
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens + 10


def test_named_tool_choice_streams_its_arguments(client: OpenAI) -> None:
    with client.responses.stream(
        model=MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=300,
        tool_choice={"type": "function", "name": "get_weather"}, extra_body={"seed": 5},
    ) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == "".join(deltas)
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)


def test_built_in_tools_and_non_text_parts_are_400s_naming_them(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools.0.type"
    assert "'web_search' is not supported" in info.value.body["message"]
    with pytest.raises(BadRequestError) as info:
        client.responses.create(
            model=MODEL, input="x", tools=[WEATHER, {"type": "code_interpreter",
                                                     "container": {"type": "auto"}}],
        )  # fmt: skip
    assert info.value.body["param"] == "tools.1.type"
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    with pytest.raises(BadRequestError) as info:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [audio]}])
    assert info.value.body["param"] == "input.0.content.0"


# ---- structured outputs ----


class Forecast(BaseModel):
    city: Literal["Oslo", "Rome", "Lima"]
    unit: Literal["c", "f"]
    high: int


def test_parse_with_a_pydantic_text_format(client: OpenAI) -> None:
    for seed in range(3):
        response = client.responses.parse(
            model=MODEL, input="Tomorrow's forecast as JSON", text_format=Forecast,
            max_output_tokens=400, extra_body={"seed": seed},
        )  # fmt: skip
        assert response.status == "completed", response.output_text
        assert isinstance(response.output_parsed, Forecast)
        assert response.text.format.type == "json_schema"


def test_json_object_format_is_json(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="JSON please", text={"format": {"type": "json_object"}},
        max_output_tokens=400, extra_body={"seed": 1},
    )  # fmt: skip
    if response.status == "completed":  # an object may run past the limit: then it is cut
        assert isinstance(json.loads(response.output_text, strict=False), dict)


# ---- streaming ----

TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done",
               "response.output_item.done", "response.incomplete"]  # fmt: skip


def test_streamed_text_events_come_in_openai_order(client: OpenAI) -> None:
    events = list(client.responses.create(
        model=MODEL, input="Stream it", max_output_tokens=8, temperature=0, stream=True
    ))  # fmt: skip
    kinds = [e.type for e in events]
    deduped = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert deduped == TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 8
    whole = client.responses.create(
        model=MODEL, input="Stream it", max_output_tokens=8, temperature=0
    )
    assert whole.output_text == text
    # What was streamed is what was stored.
    assert client.responses.retrieve(final.id).output_text == text


# ---- the store: previous_response_id over two ingress replicas, GET, DELETE ----


def test_previous_response_id_continues_on_the_other_ingress_replica(
    client: OpenAI, base_url: str
) -> None:
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="First turn", max_output_tokens=4, temperature=0
    )
    first, first_replica = raw.parse(), raw.headers[INGRESS_REPLICA_HEADER]
    # Serve's proxy spreads requests over both replicas: ask until the other one answers.
    for _ in range(40):
        raw = client.responses.with_raw_response.create(
            model=MODEL, input="Second turn", previous_response_id=first.id,
            max_output_tokens=4, temperature=0,
        )  # fmt: skip
        if raw.headers[INGRESS_REPLICA_HEADER] != first_replica:
            break
    else:
        pytest.fail("every request went to one ingress replica")
    second = raw.parse()
    assert second.previous_response_id == first.id
    messages = [{"role": "user", "content": "First turn"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Second turn"}]  # fmt: skip
    assert second.usage.input_tokens == prompt_tokens(base_url, messages)
    # A third turn from the second: the whole chain, whichever replica serves it.
    third = client.responses.create(
        model=MODEL, input="Third", previous_response_id=second.id, max_output_tokens=2
    )
    messages += [{"role": "assistant", "content": second.output_text},
                 {"role": "user", "content": "Third"}]  # fmt: skip
    assert third.usage.input_tokens == prompt_tokens(base_url, messages)


def test_get_and_delete(client: OpenAI) -> None:
    created = client.responses.create(model=MODEL, input="Keep me", max_output_tokens=3)
    for _ in range(4):  # both replicas find it
        fetched = client.responses.retrieve(created.id)
        assert fetched.id == created.id and fetched.output_text == created.output_text
    client.responses.delete(created.id)
    with pytest.raises(NotFoundError) as info:
        client.responses.retrieve(created.id)
    assert info.value.body["message"] == f"Response with id {created.id!r} not found."
    with pytest.raises(NotFoundError):
        client.responses.delete(created.id)
    with pytest.raises(NotFoundError) as info:
        client.responses.create(model=MODEL, input="x", previous_response_id=created.id)
    assert info.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Forget me", max_output_tokens=2, store=False
    )
    with pytest.raises(NotFoundError):
        client.responses.retrieve(response.id)


# ---- the OpenAI Agents SDK ----


def _weather_agent(base_url: str, calls: list[tuple[str, str]]) -> Any:
    """An agent whose first turn is forced to call its tool; the SDK then resets tool_choice
    to auto, and the output type's JSON schema makes the second turn a final answer."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace export to OpenAI

    @function_tool
    def get_weather(city: Literal["Oslo", "Rome"], unit: Literal["c", "f"]) -> str:
        """Current weather in a city."""
        calls.append((city, unit))
        return "sunny, 21 degrees"

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    return Agent(
        name="weather", instructions="Use the tool, then answer.", tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=400,
                                     extra_body={"seed": 7}),
        output_type=Forecast,
    )  # fmt: skip


def _check_agent_run(result: Any, calls: list[tuple[str, str]]) -> None:
    assert len(calls) == 1 and calls[0][0] in ("Oslo", "Rome")
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert isinstance(result.final_output, Forecast)
    assert len(result.raw_responses) == 2


def test_agent_runs_a_function_tool_then_answers_in_its_output_type(base_url: str) -> None:
    from agents import Runner

    calls: list[tuple[str, str]] = []
    agent = _weather_agent(base_url, calls)
    result = Runner.run_sync(agent, "What's the weather in Oslo?", max_turns=3)
    _check_agent_run(result, calls)


def test_streamed_agent_run(base_url: str) -> None:
    from agents import Runner

    calls: list[tuple[str, str]] = []

    async def run() -> tuple[Any, list[str]]:
        result = Runner.run_streamed(_weather_agent(base_url, calls), "Weather?", max_turns=3)
        kinds = [e.data.type async for e in result.stream_events()
                 if e.type == "raw_response_event"]  # fmt: skip
        return result, kinds

    result, kinds = asyncio.run(run())
    _check_agent_run(result, calls)
    # Both turns streamed: a call's arguments, then the answer's text.
    assert kinds.count("response.completed") == 2
    assert "response.function_call_arguments.delta" in kinds
    assert "response.output_text.delta" in kinds
