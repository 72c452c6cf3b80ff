"""The OpenAI front without Ray: request validation -> 400 naming the field, the API-key and
body-size guard, and the mapping of OpenAI fields to the engine's sampling parameters."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import msgspec
import pytest
import xgrammar as xgr
from fastapi.testclient import TestClient
from pydantic import BaseModel
from transformers import AutoTokenizer

from cluster.api import openai_payloads
from cluster.api.api_errors import APIError
from cluster.api.openai_api import make_openai_app, new_app
from cluster.api.openai_models import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from cluster.api.openai_responses import Completion, chat_logprobs, completion_logprobs
from cluster.api.replica_messages import GenerateRequest, StreamDelta, StreamStart, logprob_rows
from engine import InvalidRequestError, SamplingParams, StructuredOutputsParams
from engine.builtin.catalog import resolve_model_source
from engine.client.core_messages import ChoiceDelta
from engine.core.structured_output import StructuredOutputManager
from engine.outputs import Logprob

ROOT = Path(__file__).resolve().parents[3]


def plain(payload: GenerateRequest) -> dict[str, Any]:
    """A ``GenerateRequest`` as plain data: unset fields left out, and its request id, which is
    new for each request."""
    data = msgspec.to_builtins(payload)
    del data["request_id"]
    return data


def completion_payload(req: CompletionRequest) -> dict[str, Any]:
    """The ``GenerateRequest`` of a one-prompt request, as plain data."""
    (payload,) = openai_payloads.completion_payloads(req)
    return plain(payload)


def chat_payload(req: ChatCompletionRequest) -> dict[str, Any]:
    return plain(openai_payloads.chat_payload(req))


KEY = "sk-test-key"
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum")


def make_client(key_hashes: list[str], max_body_bytes: int = 4096) -> TestClient:
    app = new_app(key_hashes, max_body_bytes)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict[str, Any]:
        return completion_payload(req)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return TestClient(app)


@pytest.fixture
def client() -> TestClient:
    return make_client([])


@pytest.fixture
def keyed() -> Iterator[TestClient]:
    yield make_client([hashlib.sha256(KEY.encode()).hexdigest()])


def assert_error(response: Any, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    return error


def test_wrong_type_is_400_naming_the_field(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": "m", "prompt": "x", "top_k": "5"})
    assert_error(response, 400, "top_k")


@pytest.mark.parametrize(
    ("field", "value"), [("stream", "yes"), ("stream_options", 5), ("stop", 5), ("prompt", 5)]
)
def test_a_field_named_like_a_union_member_keeps_its_name(
    client: TestClient, field: str, value: Any
) -> None:
    """``stream`` starts with ``str``, a union member's tag in pydantic's error location."""
    body = {"model": "m", "prompt": "x", field: value}
    error = assert_error(client.post("/v1/completions", json=body), 400, field)
    assert error["message"].startswith(f"{field}: ")


def test_malformed_json_is_400(client: TestClient) -> None:
    response = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert assert_error(response, 400, None)["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("content", "content_type"),
    [(b"", "application/json"), (b'{"model": "m", "prompt": "x"}', "text/plain")],
)
def test_a_body_that_is_no_json_object_is_400_saying_what_to_send(
    client: TestClient, content: bytes, content_type: str
) -> None:
    response = client.post("/v1/completions", content=content,
                           headers={"content-type": content_type})  # fmt: skip
    message = assert_error(response, 400, None)["message"]
    assert message.startswith("request body: ") and "application/json" in message, message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "m", "prompt": "\\ud800"}', "prompt"),
        (b'{"model": "m", "prompt": ["\\udfff"]}', "prompt.0"),
        (b'{"model": "m", "prompt": "x", "stop": ["ok", "\\ud800"]}', "stop.1"),
        (b'{"model": "m", "prompt": "x", "cache_salt": "\\ud800"}', "cache_salt"),
        (b'{"model": "\\ud800", "prompt": "x"}', "model"),
    ],
)
def test_lone_surrogate_is_400_naming_the_field(
    client: TestClient, body: bytes, param: str
) -> None:
    # Valid JSON, but no text: the tokenizer, the prefix-cache hash and a UTF-8 error body
    # echoing it (an unknown model's 404) would each fail on it with a 500.
    response = client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    error = assert_error(response, 400, param)
    assert error["message"] == f"{param}: must be valid Unicode text (no lone surrogates)"


def test_surrogate_pair_is_text(client: TestClient) -> None:
    body = b'{"model": "m", "prompt": "\\ud83d\\ude00"}'
    response = client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.json()["prompt"] == "\U0001f600"


def _documented_ranges() -> dict[str, dict[str, Any]]:
    """The completions fields the engine's ``SamplingParams`` checks -> their schema."""
    properties = CompletionRequest.model_json_schema()["properties"]
    return {
        name: prop
        for name, prop in properties.items()
        if name in SamplingParams.__struct_fields__
        and set(_BOUNDS) & set(prop)
        # 0 is documented for echo without generation (the engine then runs max_tokens 1):
        # test_max_tokens_zero_needs_echo.
        and name != "max_tokens"
    }


@pytest.mark.parametrize("name", list(_documented_ranges()))
def test_documented_range_is_the_one_the_engine_checks(name: str) -> None:
    prop = _documented_ranges()[name]
    types = {prop.get("type")} | {member.get("type") for member in prop.get("anyOf", [])}
    step = 1 if "integer" in types else 0.01
    accepted, rejected = [], []
    if "minimum" in prop:
        accepted.append(prop["minimum"])
        rejected.append(prop["minimum"] - step)
    if "maximum" in prop:
        accepted.append(prop["maximum"])
        rejected.append(prop["maximum"] + step)
    if "exclusiveMinimum" in prop:
        accepted.append(prop["exclusiveMinimum"] + step)
        rejected.append(prop["exclusiveMinimum"])
    for value in accepted:
        SamplingParams(**{name: value})
    for value in rejected:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**{name: value})
        assert info.value.param == name


def test_harmless_unknown_fields_are_accepted_and_ignored(client: TestClient) -> None:
    body = {"model": "m", "prompt": "x", "metadata": {"k": "v"}, "store": True,
            "service_tier": "auto", "reasoning_effort": "low", "modalities": ["text"]}  # fmt: skip
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.json() == completion_payload(CompletionRequest(model="m", prompt="x"))


@pytest.mark.parametrize(
    "field", ["functions", "function_call", "audio", "web_search_options", "logits_processors"]
)
def test_unknown_fields_that_change_the_output_are_400_naming_them(
    client: TestClient, field: str
) -> None:
    response = client.post("/v1/completions", json={"model": "m", "prompt": "x", field: {}})
    assert assert_error(response, 400, field)["code"] == "unsupported"


@pytest.mark.parametrize(
    ("field", "value", "off"),
    [
        ("use_beam_search", True, False),
        ("length_penalty", 0.5, 1.0),
        ("return_tokens_as_token_ids", True, False),
        ("return_token_ids", True, False),
        ("logprob_token_ids", [1, 2], []),
        ("prompt_embeds", "AAAA", None),
        ("thinking_token_budget", 10, -1),
        ("vllm_xargs", {"k": 1}, {}),
        ("mm_processor_kwargs", {"max_pixels": 1024}, {}),
        ("media_io_kwargs", {"image": {"mode": "RGB"}}, {}),
        ("kv_transfer_params", {"do_remote_decode": True}, {}),
    ],
)
@pytest.mark.parametrize("chat", [False, True])
def test_vllm_fields_not_served_are_400_unless_they_change_nothing(
    chat: bool, field: str, value: Any, off: Any
) -> None:
    """vLLM's extensions that would change the output: a 400 naming them, not dropped; their
    default (what vLLM's clients send unasked) is accepted."""

    def payload(extra: dict[str, Any]) -> Any:
        if chat:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
            return openai_payloads.chat_payload(ChatCompletionRequest.model_validate(body))
        body = {"model": "m", "prompt": "x", **extra}
        return openai_payloads.completion_payloads(CompletionRequest.model_validate(body))

    with pytest.raises(APIError) as info:
        payload({field: value})
    assert (info.value.status, info.value.param, info.value.code) == (400, field, "unsupported")
    payload({field: off})


@pytest.mark.parametrize(("field", "value"), [("mm_payload", "tensors"), ("mm_payload", "none"),
                                            ("return_token_offsets", True)])  # fmt: skip
def test_vllms_render_only_fields_are_ignored_as_vllm_ignores_them(field: str, value: Any) -> None:
    """vLLM documents them as read by its render endpoints only, ignored on generation (a
    client dumping vLLM's request model with its defaults sends mm_payload: 'tensors')."""
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})
    assert completion_payload(req) == completion_payload(CompletionRequest(model="m", prompt="x"))


def test_max_tokens_null_is_16_on_completions_and_no_limit_on_chat() -> None:
    """vLLM's defaults: null max_tokens is the field's default, 16, on completions; on chat
    there is no default (the context's end)."""
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": None})
    assert completion_payload(req)["params"]["max_tokens"] == 16
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": None}
    assert chat_payload(ChatCompletionRequest.model_validate(chat))["params"]["max_tokens"] is None


def test_priority_reaches_the_replica_and_a_bad_one_is_400(client: TestClient) -> None:
    req = CompletionRequest(model="m", prompt="x", priority=-3)
    assert completion_payload(req)["priority"] == -3
    assert "priority" not in completion_payload(CompletionRequest(model="m", prompt="x"))
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": 5}
    assert chat_payload(ChatCompletionRequest.model_validate(chat))["priority"] == 5
    for bad in ("high", 1.5, True):  # out of int64: the engine's 400
        body = {"model": "m", "prompt": "x", "priority": bad}
        assert_error(client.post("/v1/completions", json=body), 400, "priority")


@pytest.mark.parametrize("backend", ["xgrammar", "auto"])
def test_guided_decoding_backend_that_changes_nothing_is_accepted(
    client: TestClient, backend: str
) -> None:
    """vLLM accepts the field and ignores it; old clients send it beside ``guided_json``."""
    body = {"model": "m", "prompt": "x", "guided_json": {"type": "object"}}
    response = client.post("/v1/completions", json={**body, "guided_decoding_backend": backend})
    assert response.status_code == 200
    assert response.json() == completion_payload(CompletionRequest(**body))


def test_other_guided_decoding_backend_is_400_naming_the_accepted_values(
    client: TestClient,
) -> None:
    body = {"model": "m", "prompt": "x", "guided_decoding_backend": "outlines"}
    error = assert_error(client.post("/v1/completions", json=body), 400, "guided_decoding_backend")
    assert error["message"].startswith("guided_decoding_backend: ")
    assert "'xgrammar'" in error["message"] and "'auto'" in error["message"]


def test_audio_modality_is_400(client: TestClient) -> None:
    body = {"model": "m", "prompt": "x", "modalities": ["text", "audio"]}
    assert_error(client.post("/v1/completions", json=body), 400, "modalities")


def test_max_tokens_zero_needs_echo() -> None:
    with pytest.raises(APIError) as info:
        completion_payload(CompletionRequest(model="m", prompt="x", max_tokens=0))
    assert (info.value.status, info.value.param) == (400, "max_tokens")
    payload = completion_payload(
        CompletionRequest(model="m", prompt="x", max_tokens=0, echo=True, logprobs=1)
    )
    assert payload["echo"] is True
    assert payload["params"]["max_tokens"] == 1  # the sampled token is left out of the response
    assert payload["params"]["prompt_logprobs"] == 1


def test_batched_prompts_make_one_payload_each() -> None:
    for prompt in (["a", "b", "c"], [[1, 2], [3]]):
        req = CompletionRequest(model="m", prompt=prompt, n=2)
        payloads = [plain(p) for p in openai_payloads.completion_payloads(req)]
        key = "prompt" if isinstance(prompt[0], str) else "prompt_token_ids"
        assert [p[key] for p in payloads] == prompt
        assert all(p["params"]["n"] == 2 for p in payloads)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
         {"json": '{"type": "integer"}'}),
        ({"structured_outputs": {"regex": "a+"}}, {"regex": "a+"}),
        ({"structured_outputs": {"json": {"type": "string"}, "disable_any_whitespace": True}},
         {"json": '{"type": "string"}', "disable_any_whitespace": True}),
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
        ({"response_format": {"type": "text"}}, None),
    ],
)  # fmt: skip
def test_structured_output_fields_map_to_the_engine(
    fields: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    params = completion_payload(CompletionRequest(model="m", prompt="x", **fields))["params"]
    assert params.get("structured_outputs") == expected


def test_two_ways_to_constrain_the_output_are_400() -> None:
    req = CompletionRequest(model="m", prompt="x", guided_regex="a",
                            response_format={"type": "json_object"})  # fmt: skip
    with pytest.raises(APIError) as info:
        completion_payload(req)
    assert info.value.status == 400 and "at most one" in info.value.message


def test_unknown_route_is_404_with_an_error_body(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404, None)


def test_missing_api_key_is_401(keyed: TestClient) -> None:
    response = keyed.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert assert_error(response, 401, None)["type"] == "AuthenticationError"


def test_wrong_api_key_is_401(keyed: TestClient) -> None:
    headers = {"authorization": "Bearer sk-wrong"}
    response = keyed.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert_error(response, 401, None)


def test_right_api_key_is_accepted(keyed: TestClient) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    response = keyed.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert response.status_code == 200


def test_health_needs_no_api_key(keyed: TestClient) -> None:
    assert keyed.get("/health").status_code == 200


def test_ping_is_health_and_version_is_the_package_s_without_a_key() -> None:
    class OnlyHealth:  # every route but /health's would call something else
        async def health(self) -> dict[str, str]:
            return {"status": "ready"}

    app = make_openai_app(OnlyHealth(), [hashlib.sha256(KEY.encode()).hexdigest()])
    with TestClient(app) as client:
        assert client.get("/ping").json() == client.post("/ping").json() == {"status": "ready"}
        pyproject = (ROOT / "pyproject.toml").read_text()
        expected = re.search(r'^version = "([^"]+)"$', pyproject, re.MULTILINE).group(1)
        assert client.get("/version").json() == {"version": expected}
        assert client.get("/v1/models").status_code == 401  # the key still guards the rest


def test_livez_answers_200_without_a_key_and_asks_no_model() -> None:
    class NoModels:  # every route but the probes' would call it
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"/livez called {name}")

    app = make_openai_app(NoModels(), [hashlib.sha256(KEY.encode()).hexdigest()])
    with TestClient(app) as client:
        response = client.get("/livez")
        assert response.status_code == 200 and response.json() == {"status": "ok"}
        assert client.get("/v1/models").status_code == 401  # the key still guards the rest


def test_key_check_uses_the_scope_path_not_a_spoofable_header(keyed: TestClient) -> None:
    headers = {"x-original-uri": "/health", "x-forwarded-path": "/health"}
    response = keyed.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert_error(response, 401, None)


def test_wrong_api_key_of_the_right_length_is_401(keyed: TestClient) -> None:
    wrong = KEY[:-1] + ("x" if KEY[-1] != "x" else "y")
    assert len(wrong) == len(KEY)
    headers = {"authorization": f"Bearer {wrong}"}
    response = keyed.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert_error(response, 401, None)


def test_wrong_x_api_key_header_is_401(keyed: TestClient) -> None:
    headers = {"x-api-key": "sk-test-kez"}
    response = keyed.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert_error(response, 401, None)


@pytest.mark.parametrize(
    "headers",
    [{"host": "localhost"}, {"host": "127.0.0.1:8000"},
     {"host": "localhost", "x-forwarded-for": "127.0.0.1", "x-real-ip": "127.0.0.1"}],
)  # fmt: skip
def test_forged_host_header_without_a_key_is_401(
    keyed: TestClient, headers: dict[str, str]
) -> None:
    response = keyed.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert_error(response, 401, None)


def test_too_many_headers_is_431(client: TestClient) -> None:
    headers = {f"x-h{i}": "1" for i in range(100)}
    response = client.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert assert_error(response, 431, None)["code"] == "too_many_headers"


def test_oversized_headers_are_431(client: TestClient) -> None:
    headers = {"x-big": "a" * 20_000}
    response = client.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert assert_error(response, 431, None)["code"] == "headers_too_large"


def test_headers_are_checked_before_the_api_key(keyed: TestClient) -> None:
    headers = {f"x-h{i}": "1" for i in range(100)}
    response = keyed.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert_error(response, 431, None)


def test_internal_errors_carry_no_trace_path_or_configuration() -> None:
    app = new_app([], 4096)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("/srv/secret/engine.py line 7: api_key_hashes=['abc'] max_model_len")

    response = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert response.status_code == 500
    assert response.json() == {"error": {"message": "internal server error", "type": "APIError",
                                         "param": None, "code": None}}  # fmt: skip
    for leak in ("Traceback", "/srv", ".py", "api_key", "max_model_len"):
        assert leak not in response.text


def test_declared_oversized_body_is_413(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": "m", "prompt": "x" * 5000})
    assert_error(response, 413, None)


def test_chunked_oversized_body_is_413(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m", "prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    response = client.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_error(response, 413, None)


def test_completion_fields_map_to_sampling_params() -> None:
    req = CompletionRequest(
        model="m", prompt="hi", temperature=0.5, top_p=0.9, top_k=40, max_tokens=7, stop="END",
        seed=3, ignore_eos=True, stop_token_ids=[2], skip_special_tokens=False,
    )  # fmt: skip
    assert completion_payload(req) == {
        "prompt": "hi",
        "params": {
            "temperature": 0.5, "top_p": 0.9, "top_k": 40, "max_tokens": 7, "stop": ["END"],
            "seed": 3, "ignore_eos": True, "stop_token_ids": [2], "skip_special_tokens": False,
        },
    }  # fmt: skip


def test_token_id_prompt_is_passed_as_ids() -> None:
    payload = completion_payload(CompletionRequest(model="m", prompt=[1, 2, 3]))
    assert payload["prompt_token_ids"] == [1, 2, 3]


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    req = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        max_completion_tokens=9,
    )  # fmt: skip
    assert chat_payload(req)["params"]["max_tokens"] == 9


def test_chat_text_parts_are_joined_one_a_line_for_the_template() -> None:
    # As vLLM joins them for a template that takes text content.
    content = [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": content}])
    assert chat_payload(req)["messages"] == [{"role": "user", "content": "Hello\n there"}]


def test_chat_reasoning_effort_and_earlier_reasoning_reach_the_template() -> None:
    """As vLLM: ``reasoning_effort`` is a template variable (gpt-oss's "Reasoning: high"); an
    assistant's ``reasoning_content`` is passed back to the template, which decides."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "reasoning_content": "think",
                 "tool_calls": [{"id": "c", "type": "function",
                                 "function": {"name": "f", "arguments": "{}"}}]}]  # fmt: skip
    req = ChatCompletionRequest(model="m", messages=messages, reasoning_effort="high")
    payload = chat_payload(req)
    assert payload["chat_template_kwargs"] == {"reasoning_effort": "high", "enable_thinking": True}
    assert payload["messages"][1]["reasoning_content"] == "think"
    assert "chat_template_kwargs" not in chat_payload(
        req.model_copy(update={"reasoning_effort": None})
    )


def test_continue_final_message_leaves_whoevers_last_message_open() -> None:
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]
    req = ChatCompletionRequest(model="m", messages=prefill, continue_final_message=True)
    assert chat_payload(req)["continue_final_message"] is True
    assert "continue_final_message" not in chat_payload(
        ChatCompletionRequest(model="m", messages=prefill)
    )
    # A user's last message too (vLLM checks no role; the template renders it open).
    user_last = chat_payload(req.model_copy(update={"messages": req.messages[:1]}))
    assert user_last["continue_final_message"] is True


def test_text_like_content_parts_are_text_as_vllm_reads_them() -> None:
    parts = [{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"},
             {"type": "refusal", "refusal": "c"}, {"type": "thinking", "thinking": "d"},
             {"type": "text", "text": None}, {"type": "text", "text": "e"}]  # fmt: skip
    messages = [{"role": "assistant", "content": parts}, {"role": "user", "content": "go on"}]
    payload = chat_payload(ChatCompletionRequest(model="m", messages=messages))
    assert payload["messages"][0]["content"] == "a\nb\nc\nd\ne"  # a null text is skipped
    bad = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    with pytest.raises(APIError) as info:
        chat_payload(ChatCompletionRequest(model="m", messages=bad))
    assert (info.value.status, info.value.param) == (400, "messages.0.content.0")


def test_chat_image_parts_are_kept_with_their_text_and_other_parts_are_400() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/a.png", "detail": "low"}}
    content = [{"type": "text", "text": "What is it?"}, image]
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": content}])
    assert chat_payload(req)["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]  # fmt: skip
    refused = [
        ({"type": "input_audio", "input_audio": {}}, "messages.0.content.1"),
        ({"type": "image_url", "image_url": {}}, "messages.0.content.1.image_url.url"),
    ]
    for bad, param in refused:
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
            {"type": "text", "text": "x"}, bad]}])  # fmt: skip
        with pytest.raises(APIError) as info:
            chat_payload(req)
        assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"),
     ({"prompt": ["a"] * 257}, "prompt")],
)  # fmt: skip
def test_unsupported_fields_are_400_naming_them(fields: dict[str, Any], param: str) -> None:
    req = CompletionRequest(**{"model": "m", "prompt": "x", **fields})
    with pytest.raises(APIError) as info:
        completion_payload(req)
    assert (info.value.status, info.value.param) == (400, param)


def test_n_penalties_and_vllm_extras_map_by_name() -> None:
    extras = {
        "n": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
        "min_p": 0.1, "min_tokens": 2, "logit_bias": {"7": -100.0, "9": 5.0},
        "include_stop_str_in_output": True, "bad_words": ["bad"],
        "spaces_between_special_tokens": False,
    }  # fmt: skip
    params = completion_payload(CompletionRequest(model="m", prompt="x", **extras))["params"]
    assert {k: params[k] for k in extras} == extras


def test_defaults_are_left_to_the_engine() -> None:
    params = completion_payload(CompletionRequest(model="m", prompt="x"))["params"]
    assert set(params) == {"max_tokens", "ignore_eos", "skip_special_tokens"}


@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty"],
)  # fmt: skip
def test_a_model_default_field_goes_to_the_replica_only_when_the_request_gives_it(
    field: str,
) -> None:
    """Unset or null, the replica fills it in from the model's generation_config (vLLM's
    rule); given, even at OpenAI's default value, it is the request's."""
    default = ChatCompletionRequest.model_fields[field].default
    for body in ({}, {field: None}):
        req = ChatCompletionRequest.model_validate({**_CHAT, **body})
        assert field not in chat_payload(req)["params"]
    req = ChatCompletionRequest.model_validate({**_CHAT, field: default})
    assert chat_payload(req)["params"][field] == default
    params = completion_payload(CompletionRequest(model="m", prompt="x", **{field: default}))
    assert params["params"][field] == default


def test_best_of_equal_to_n_is_accepted() -> None:
    req = CompletionRequest(model="m", prompt="x", n=2, best_of=2)
    assert completion_payload(req)["params"]["n"] == 2


def test_completion_logprobs_is_the_engine_logprobs() -> None:
    req = CompletionRequest(model="m", prompt="x", logprobs=3)
    assert completion_payload(req)["params"]["logprobs"] == 3


def test_chat_top_logprobs_is_the_engine_logprobs() -> None:
    messages = [{"role": "user", "content": "hi"}]
    with_top = ChatCompletionRequest(model="m", messages=messages, logprobs=True, top_logprobs=2)
    without = ChatCompletionRequest(model="m", messages=messages, logprobs=True)
    assert chat_payload(with_top)["params"]["logprobs"] == 2
    assert chat_payload(without)["params"]["logprobs"] == 0
    assert (
        "logprobs"
        not in chat_payload(ChatCompletionRequest(model="m", messages=messages))["params"]
    )


def test_chat_top_logprobs_without_logprobs_is_400_unless_0() -> None:
    messages = [{"role": "user", "content": "hi"}]
    req = ChatCompletionRequest(model="m", messages=messages, top_logprobs=2)
    with pytest.raises(APIError) as info:
        chat_payload(req)
    assert (info.value.status, info.value.param) == (400, "top_logprobs")
    # 0 is vLLM's default, which its clients send with logprobs off: no logprobs, no 400.
    for logprobs in (None, False):
        quiet = ChatCompletionRequest(model="m", messages=messages, top_logprobs=0,
                                      logprobs=logprobs)  # fmt: skip
        assert "logprobs" not in chat_payload(quiet)["params"]


def test_stream_options_without_stream_is_400_unless_empty() -> None:
    messages = [{"role": "user", "content": "hi"}]
    req = ChatCompletionRequest(
        model="m", messages=messages, stream_options={"include_usage": True}
    )
    with pytest.raises(APIError) as info:
        chat_payload(req)
    assert (info.value.status, info.value.param) == (400, "stream_options")
    for options in ({}, {"include_usage": None}):  # no option set (a null is no value)
        empty = ChatCompletionRequest(model="m", messages=messages, stream_options=options)
        assert chat_payload(empty)["messages"] == messages


# ---- responses from the server's items ----

# Two generated tokens as the engine sends them (token id -> Logprob, the sampled token first,
# then the top-2 not already listed) and as OpenAI rows ([token_id, text, logprob, rank]).
# " a" is the most likely token; "z" is sampled at rank 4, below its top-2.
LOGPROBS = [
    {5: Logprob(-0.5, 1, " a"), 6: Logprob(-1.5, 2, " b")},
    {8: Logprob(-3.0, 4, "z"), 7: Logprob(-0.2, 1, "y"), 9: Logprob(-2.0, 2, "w")},
]
ENTRIES = [
    [[5, " a", -0.5, 1], [6, " b", -1.5, 2]],
    [[8, "z", -3.0, 4], [7, "y", -0.2, 1], [9, "w", -2.0, 2]],
]


def delta(index: int, text: str, tokens: int, finish: str | None = None, **kw: Any) -> Any:
    logprobs = kw.get("logprobs")
    token_ids = kw.get("token_ids", [1] * len(logprobs or []))
    return StreamDelta([ChoiceDelta(index, text, token_ids, logprobs, finish, None, tokens)])


def test_logprob_rows_are_the_engine_logprobs_sampled_token_first() -> None:
    assert [logprob_rows(entry) for entry in LOGPROBS] == ENTRIES


def test_completion_logprobs_format() -> None:
    assert completion_logprobs(ENTRIES, text_offset=4) == {
        "tokens": [" a", "z"],
        "token_logprobs": [-0.5, -3.0],
        "top_logprobs": [{" a": -0.5, " b": -1.5}, {"z": -3.0, "y": -0.2, "w": -2.0}],
        "text_offset": [4, 6],
    }


def test_chat_logprobs_keep_the_k_most_likely_alternatives() -> None:
    content = chat_logprobs(ENTRIES, top_k=2)
    assert [c["token"] for c in content] == [" a", "z"]
    assert content[1]["bytes"] == [ord("z")]
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["y", "w"]
    assert [t["token"] for t in content[0]["top_logprobs"]] == [" a", " b"]


def test_minus_infinity_becomes_a_json_number() -> None:
    rows = [[[3, "q", float("-inf"), 50], [4, "r", -0.1, 1]]]
    assert completion_logprobs(rows)["token_logprobs"] == [-9999.0]


def test_n_choices_accumulate_by_index_and_usage_sums_them() -> None:
    completion = Completion("m", chat=False, include_usage=False)
    completion.absorb(StreamStart(4, 2))
    for item in [delta(1, "B", 1), delta(0, "A", 1), delta(1, "b", 2, "length"),
                 delta(0, "a", 2, "stop")]:  # fmt: skip
        completion.absorb(item)
    whole = completion.whole()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "Aa", "stop"), (1, "Bb", "length")
    ]  # fmt: skip
    assert whole["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


def test_a_delta_with_tokens_but_no_text_is_still_a_chunk() -> None:
    # An incomplete UTF-8 character (or a special token) has no text yet: like vLLM, the step
    # still makes a chunk, so clients see every token's timing.
    completion = Completion("m", chat=False, include_usage=False)
    completion.absorb(StreamStart(1, 1))
    items = [delta(0, "a", 1, token_ids=[3]), delta(0, "", 2, token_ids=[4]),
             delta(0, "", 3, token_ids=[5]), delta(0, "é", 3, "length", token_ids=[])]  # fmt: skip
    chunks = [c for item in items for c in completion.absorb(item)]
    assert [(c["text"], c["finish_reason"]) for c in chunks] == [
        ("a", None), ("", None), ("", None), ("é", "length")
    ]  # fmt: skip


def test_stream_chunks_name_their_choice_and_carry_role_once_per_choice() -> None:
    completion = Completion("m", chat=True, include_usage=False)
    completion.absorb(StreamStart(4, 2))
    chunks = [c for i in [delta(1, "B", 1), delta(0, "A", 1), delta(1, "b", 2)]
              for c in completion.absorb(i)]  # fmt: skip
    assert [(c["index"], c["delta"]) for c in chunks] == [
        (1, {"role": "assistant", "content": "B"}), (0, {"role": "assistant", "content": "A"}),
        (1, {"content": "b"}),
    ]  # fmt: skip


def test_streamed_logprobs_are_those_of_each_chunk_and_add_up_to_the_whole() -> None:
    completion = Completion("m", chat=False, include_usage=False, top_logprobs=2)
    completion.absorb(StreamStart(1, 1))
    first = completion.absorb(delta(0, " a", 1, logprobs=LOGPROBS[:1]))[0]["logprobs"]
    second = completion.absorb(delta(0, "z", 2, "length", logprobs=LOGPROBS[1:]))[0]["logprobs"]
    assert (first["tokens"], second["tokens"]) == ([" a"], ["z"])
    assert second["text_offset"] == [2]
    assert completion.whole()["choices"][0]["logprobs"] == completion_logprobs(ENTRIES)


def test_chat_whole_response_has_logprobs_content() -> None:
    completion = Completion("m", chat=True, include_usage=False, top_logprobs=1)
    completion.absorb(StreamStart(1, 1))
    completion.absorb(delta(0, " az", 2, "length", logprobs=LOGPROBS))
    content = completion.whole()["choices"][0]["logprobs"]["content"]
    assert content == chat_logprobs(ENTRIES, 1)


@pytest.mark.parametrize("route", ["chat", "tokenize"])
@pytest.mark.parametrize(
    ("field", "value"),
    [("chat_template", "{{ messages }}"), ("chat_template_kwargs", {"chat_template": "{{ x }}"}),
     ("chat_template_kwargs", {"tokenize": False})],
)  # fmt: skip
def test_request_supplied_chat_template_is_400_naming_it(
    field: str, value: Any, route: str
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(APIError) as info:
        if route == "chat":
            chat_payload(ChatCompletionRequest(**body))
        else:
            openai_payloads.tokenize_payload(TokenizeRequest(**body))
    assert (info.value.status, info.value.param) == (400, field)


def test_tokenize_refuses_continue_final_message_with_add_generation_prompt() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]
    req = TokenizeRequest(
        model="m", messages=messages, continue_final_message=True, add_generation_prompt=True
    )
    with pytest.raises(APIError) as info:
        openai_payloads.tokenize_payload(req)
    assert (info.value.status, info.value.param) == (400, "add_generation_prompt")


def test_cache_salt_and_timeout_reach_the_server_beside_the_params() -> None:
    req = CompletionRequest(model="m", prompt="x", cache_salt="tenant-1", timeout=2.5)
    payload = completion_payload(req)
    assert (payload["cache_salt"], payload["timeout"]) == ("tenant-1", 2.5)
    assert "cache_salt" not in payload["params"] and "timeout" not in payload["params"]
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 cache_salt="t", timeout=1)  # fmt: skip
    assert (chat_payload(chat)["cache_salt"], chat_payload(chat)["timeout"]) == ("t", 1)


def test_no_salt_and_no_timeout_leave_the_payload_unchanged() -> None:
    payload = completion_payload(CompletionRequest(model="m", prompt="x"))
    assert "cache_salt" not in payload and "timeout" not in payload


def test_retry_after_becomes_a_header() -> None:
    app = new_app([], 4096)

    @app.get("/busy")
    async def busy() -> None:
        raise APIError(503, "model 'm' is overloaded", None, "overloaded", retry_after=2)

    response = TestClient(app).get("/busy")
    assert assert_error(response, 503, None)["code"] == "overloaded"
    assert response.headers["retry-after"] == "2"


class _FakeStream:
    def __init__(self, first: dict[str, Any] | Exception) -> None:
        self.first = first

    async def __anext__(self) -> dict[str, Any]:
        if isinstance(self.first, Exception):
            raise self.first
        return self.first


class _FakeHandle:
    """A deployment handle whose ``generate`` stream starts with ``first``."""

    def __init__(self, first: dict[str, Any] | Exception) -> None:
        self.first = first
        self.generate = self

    def options(self, **_: Any) -> _FakeHandle:
        return self

    def remote(self, payload: dict[str, Any]) -> _FakeStream:
        return _FakeStream(self.first)


def _open_stream(first: dict[str, Any] | Exception, stopping: bool = False) -> APIError:
    import asyncio
    import functools
    from types import SimpleNamespace

    from cluster.serving.ingress import OpenAIIngress
    from cluster.serving.token_channel import TokenChannel

    ingress = SimpleNamespace(_route=lambda model: (_FakeHandle(first), None),
                              _stopping=lambda: stopping, cold_start_timeouts={},
                              channel=TokenChannel(), prefill={}, awake=None)  # fmt: skip
    ingress._first_item = functools.partial(OpenAIIngress._first_item, ingress)
    ingress._admit = functools.partial(OpenAIIngress._admit, ingress)
    ingress._with_image_data = functools.partial(OpenAIIngress._with_image_data, ingress)
    with pytest.raises(APIError) as info:
        asyncio.run(OpenAIIngress.open_stream(ingress, "m", GenerateRequest()))  # type: ignore[arg-type]
    assert not ingress.channel._queues  # the refused request left nothing registered
    return info.value


def test_each_request_is_made_with_its_own_request_id() -> None:
    from cluster.api.replica_messages import EmbedRequest

    ids = [GenerateRequest().request_id, GenerateRequest().request_id, EmbedRequest().request_id]
    assert len(set(ids)) == 3 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_ingress_sends_and_registers_the_payloads_own_request_id() -> None:
    import asyncio
    import functools
    from types import SimpleNamespace

    from cluster.serving.ingress import OpenAIIngress

    sent: list[GenerateRequest] = []
    registered: list[str] = []

    class Channel:
        async def sink(self) -> str:
            return "tcp://127.0.0.1:1/t"

        def register(self, request_id: str) -> None:
            registered.append(request_id)

        def release(self, request_id: str) -> None:
            pass

    async def first_item(handle: Any, payload: GenerateRequest, *_: Any) -> Any:
        sent.append(payload)
        return StreamStart(1, 1), None  # no head: the deltas would follow on the stream

    ingress = SimpleNamespace(_route=lambda model: (None, None), _stopping=None,
                              channel=Channel(), _first_item=first_item, prefill={},
                              awake=None)  # fmt: skip
    ingress._admit = functools.partial(OpenAIIngress._admit, ingress)
    ingress._with_image_data = functools.partial(OpenAIIngress._with_image_data, ingress)
    payload = GenerateRequest(prompt="x")
    asyncio.run(OpenAIIngress.open_stream(ingress, "m", payload))  # type: ignore[arg-type]
    assert registered == [payload.request_id] and sent[0].request_id == payload.request_id


def test_a_stopping_ingress_refuses_new_generations_with_503_draining() -> None:
    error = _open_stream(StreamStart(1, 1), stopping=True)
    assert (error.status, error.code, error.retry_after) == (503, "draining", 1)


def test_ingress_turns_a_full_queue_into_a_503_with_retry_after() -> None:
    from cluster.serving.llm_server import error_item

    error = _open_stream(error_item(503, "queue full", None, "overloaded", 1))
    assert (error.status, error.code, error.retry_after) == (503, "overloaded", 1)


def test_ingress_turns_serve_back_pressure_into_a_503_with_retry_after() -> None:
    from ray.serve.exceptions import BackPressureError

    error = _open_stream(BackPressureError(num_queued_requests=5, max_queued_requests=5))
    assert (error.status, error.code, error.retry_after) == (503, "overloaded", 1)


def test_overload_is_resource_exhausted_over_grpc() -> None:
    import grpc

    from cluster.serving.grpc_ingress import grpc_abort

    class Context:
        def set_code(self, code: Any) -> None:
            self.code = code

        def set_details(self, details: str) -> None:
            self.details = details

        def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
            self.trailing = dict(metadata)

    context = Context()
    with pytest.raises(APIError):
        grpc_abort(context, APIError(503, "full", None, "overloaded", 1))  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert context.trailing == {"retry-after": "1"}
    with pytest.raises(APIError):
        grpc_abort(context, APIError(503, "dead", None, "engine_dead"))  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.UNAVAILABLE


class _Recorder:
    """An OpenAI serving that answers with the timeout each request arrived with (and its
    priority, when not 0)."""

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        return {"timeout": req.timeout} | ({"priority": req.priority} if req.priority else {})

    async def chat_completions(self, req: ChatCompletionRequest) -> dict[str, Any]:
        return await self.completions(req)  # type: ignore[arg-type]

    async def responses(self, req: Any) -> dict[str, Any]:
        return {"timeout": req.timeout, "priority": req.priority}


@pytest.fixture
def recorder() -> TestClient:
    from cluster.api.openai_api import make_openai_app

    return TestClient(make_openai_app(_Recorder()))  # type: ignore[arg-type]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_x_request_timeout_header_sets_the_timeout(recorder: TestClient, route: str) -> None:
    body: dict[str, Any] = {"model": "m", "prompt": "x"}
    if route.endswith("chat/completions"):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    response = recorder.post(route, json=body, headers={"x-request-timeout": "2.5"})
    assert response.json() == {"timeout": 2.5}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_x_vllm_priority_header_sets_the_priority_over_the_body(
    recorder: TestClient, route: str
) -> None:
    body: dict[str, Any] = {"model": "m", "prompt": "x", "priority": 4}
    if route.endswith("chat/completions"):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": 4}
    elif route.endswith("responses"):
        body = {"model": "m", "input": "x", "priority": 4}
    assert recorder.post(route, json=body).json()["priority"] == 4
    response = recorder.post(route, json=body, headers={"x-vllm-priority": "-2"})
    assert response.json()["priority"] == -2
    response = recorder.post(route, json=body, headers={"x-vllm-priority": "soon"})
    assert_error(response, 400, "x-vllm-priority")


def test_timeout_field_wins_over_the_header(recorder: TestClient) -> None:
    body = {"model": "m", "prompt": "x", "timeout": 7}
    response = recorder.post("/v1/completions", json=body, headers={"x-request-timeout": "2"})
    assert response.json() == {"timeout": 7}


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "inf"])
def test_bad_x_request_timeout_is_400_naming_it(recorder: TestClient, value: str) -> None:
    body = {"model": "m", "prompt": "x"}
    response = recorder.post("/v1/completions", json=body, headers={"x-request-timeout": value})
    assert_error(response, 400, "x-request-timeout")


# ---- tool calls in responses ----


def _tool_request(**fields: Any) -> ChatCompletionRequest:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    fields.setdefault("messages", [{"role": "user", "content": "weather?"}])
    return ChatCompletionRequest(model="m", tools=[tool], **fields)


def _tool_completion(req: ChatCompletionRequest, stream: bool, parser: str | None) -> Completion:
    completion = Completion("m", True, False, tools=openai_payloads.tool_choice(req),
                            stream=stream)  # fmt: skip
    completion.absorb(StreamStart(5, 1, tool_call_parser=parser))
    return completion


def _feed(completion: Completion, pieces: list[str], finish: str = "stop") -> list[dict[str, Any]]:
    chunks = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = ChoiceDelta(0, text, [1], None, finish if last else None, None, i + 1)
        chunks += completion.absorb(StreamDelta([delta]))
    return chunks


HERMES_OUTPUT = (
    'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
)


def test_auto_tool_call_is_parsed_with_the_models_parser() -> None:
    completion = _tool_completion(_tool_request(), False, "hermes")
    _feed(completion, [HERMES_OUTPUT[:12], HERMES_OUTPUT[12:]])
    choice = completion.whole()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert call["id"].startswith("call_") and call["type"] == "function"


def test_streamed_auto_tool_call_joins_to_the_whole_one() -> None:
    completion = _tool_completion(_tool_request(), True, "hermes")
    pieces = [HERMES_OUTPUT[i : i + 5] for i in range(0, len(HERMES_OUTPUT), 5)]
    chunks = _feed(completion, pieces)
    assert chunks[0]["delta"]["role"] == "assistant"
    assert chunks[-1]["finish_reason"] == "tool_calls"
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
    assert content == "Checking."
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Oslo"}'


def test_glm45_reads_a_value_the_tool_declares_a_string_as_written() -> None:
    """The request's tools reach the parser: ``city`` is a string parameter, so ``123`` stays
    "123" (a parameter the schema does not name would be read as JSON, a number)."""
    completion = _tool_completion(_tool_request(), True, "glm45")
    text = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")  # fmt: skip
    chunks = _feed(completion, [text[:30], text[30:]])
    calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(t["function"]["arguments"] for t in calls)
    assert json.loads(arguments) == {"city": "123", "days": 2}
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_named_tool_choice_constrains_to_the_tools_schema_and_ends_with_stop() -> None:
    req = _tool_request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    payload = chat_payload(req)
    schema = json.loads(payload["params"]["structured_outputs"]["json"])
    assert schema["properties"] == {"city": {"type": "string"}}
    completion = _tool_completion(req, False, None)
    _feed(completion, ['{"city": ', '"Oslo"}'])
    choice = completion.whole()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_required_tool_choice_reads_an_array_of_calls() -> None:
    req = _tool_request(tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(chat_payload(req)["params"]["structured_outputs"]["json"])
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    completion = _tool_completion(req, True, None)
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    chunks = _feed(completion, [text[:20], text[20:]])
    calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
    assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Rome"}'
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_tool_choice_errors_name_the_field() -> None:
    bad_name = _tool_request(tool_choice={"type": "function", "function": {"name": "nope"}})
    without_tools = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}], tool_choice="required"
    )
    for req, param in ((bad_name, "tool_choice.function.name"), (without_tools, "tool_choice")):
        with pytest.raises(APIError) as info:
            chat_payload(req)
        assert (info.value.status, info.value.param) == (400, param)


_NAMED = {"type": "function", "function": {"name": "get_weather"}}
_OUT_FORMAT = {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}}}


@pytest.mark.parametrize("choice", ["required", _NAMED])
@pytest.mark.parametrize("response_format", [{"type": "json_object"}, _OUT_FORMAT])
def test_forced_call_replaces_response_format_with_the_tools_schema(
    choice: Any, response_format: dict[str, Any]
) -> None:
    """As vLLM and OpenAI do (the Agents SDK sends both): the format shapes a message's text,
    and a forced call writes none."""
    forced = _tool_request(tool_choice=choice, response_format=response_format)
    alone = _tool_request(tool_choice=choice)
    params = chat_payload(forced)["params"]
    assert params["structured_outputs"] == chat_payload(alone)["params"]["structured_outputs"]


@pytest.mark.parametrize("choice", ["required", _NAMED])
@pytest.mark.parametrize(
    "fields",
    [{"structured_outputs": {"regex": "a+"}}, {"guided_json": {"type": "object"}},
     {"guided_choice": ["a", "b"]}],
)  # fmt: skip
def test_forced_call_with_an_explicit_grammar_is_400_naming_it(
    choice: Any, fields: dict[str, Any]
) -> None:
    (name,) = fields
    with pytest.raises(APIError) as info:
        chat_payload(_tool_request(tool_choice=choice, **fields))
    assert (info.value.status, info.value.param) == (400, name)
    assert info.value.message.startswith(f"{name}: cannot be combined with a forced tool call")


class Unit(str, Enum):
    C = "c"
    F = "f"


class Weather(BaseModel):
    unit: Unit


# Tools as pydantic (and the Agents SDK) write them: a nested type is a root-relative $ref.
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "weather", "parameters": Weather.model_json_schema()},
}
WHEN_TOOL = {"type": "function", "function": {"name": "when", "parameters": {
    "type": "object", "properties": {"day": {"$ref": "#/definitions/Day"},
                                     "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["day"], "additionalProperties": False,
    "definitions": {"Day": {"enum": ["mon", "tue"]}},
    "$defs": Weather.model_json_schema()["$defs"]}}}  # fmt: skip


def _forced(tools: list[dict[str, Any]], choice: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "x"}]
    return ChatCompletionRequest(model="m", messages=messages, tools=tools, tool_choice=choice)


@pytest.fixture(scope="module")
def grammars() -> StructuredOutputManager:
    """The engine's grammar compiler, over the tiny Llama's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source("builtin:tiny-llama"))
    return StructuredOutputManager(tokenizer, len(tokenizer))


def _grammar_accepts(grammars: StructuredOutputManager, payload: dict[str, Any], text: str) -> bool:
    spec = StructuredOutputsParams(**payload["params"]["structured_outputs"])
    matcher = xgr.GrammarMatcher(grammars.compile(spec), terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_required_tools_with_definitions_compile_and_accept_their_calls(
    grammars: StructuredOutputManager,
) -> None:
    payload = chat_payload(_forced([WEATHER_TOOL, WHEN_TOOL], "required"))
    calls = [{"name": "weather", "parameters": {"unit": "c"}},
             {"name": "when", "parameters": {"day": "tue", "unit": "f"}}]  # fmt: skip
    assert _grammar_accepts(grammars, payload, json.dumps(calls))
    calls[1]["parameters"]["day"] = "sun"
    assert not _grammar_accepts(grammars, payload, json.dumps(calls))


def test_named_tool_with_definitions_compiles_and_accepts_its_arguments(
    grammars: StructuredOutputManager,
) -> None:
    choice = {"type": "function", "function": {"name": "weather"}}
    payload = chat_payload(_forced([WEATHER_TOOL, WHEN_TOOL], choice))
    assert _grammar_accepts(grammars, payload, '{"unit": "f"}')
    assert not _grammar_accepts(grammars, payload, '{"unit": "k"}')


def test_required_tools_defining_one_name_differently_are_400_naming_the_definition() -> None:
    other = json.loads(json.dumps(WHEN_TOOL))
    other["function"]["parameters"]["$defs"]["Unit"] = {"enum": ["k"]}
    with pytest.raises(APIError) as info:
        chat_payload(_forced([WEATHER_TOOL, other], "required"))
    param = "tools.1.function.parameters.$defs.Unit"
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(f"{param}: ")


class _PayloadOnly:
    """An OpenAI serving that answers with the replica payload a request becomes: the HTTP API's
    checks with no replica behind them."""

    async def completions(self, req: CompletionRequest) -> Any:
        return [plain(p) for p in openai_payloads.completion_payloads(req)]

    async def chat_completions(self, req: ChatCompletionRequest) -> Any:
        return plain(openai_payloads.chat_payload(req))


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name",
         "tool_choice.function.name: no tool named 'nope' (tools: get_weather)"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice: requires tools"),
    ],
)  # fmt: skip
def test_tool_choice_the_tools_cannot_meet_is_a_400_from_the_http_api(
    fields: dict[str, Any], param: str, message: str
) -> None:
    client = TestClient(make_openai_app(_PayloadOnly()))  # type: ignore[arg-type]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    error = assert_error(client.post("/v1/chat/completions", json=body), 400, param)
    assert error["message"] == message


def test_tool_without_a_function_name_is_a_400_from_the_http_api() -> None:
    client = TestClient(make_openai_app(_PayloadOnly()))  # type: ignore[arg-type]
    tool = {"type": "function", "function": {"description": "no name"}}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [tool],
            "tool_choice": "required"}  # fmt: skip
    assert_error(client.post("/v1/chat/completions", json=body), 400, "tools.0.function.name")


def test_tool_round_trip_messages_reach_the_template() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    req = _tool_request(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])  # fmt: skip
    messages = chat_payload(req)["messages"]
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


# ---- vLLM conformance: nulls, stop_reason, usage, template options, forced calls ----

_CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
_COMPLETION = {"model": "m", "prompt": "x"}
_NULLABLE_SAMPLING = ["temperature", "top_p", "n", "stream", "presence_penalty",
                      "frequency_penalty", "top_k", "min_p", "repetition_penalty", "seed", "stop",
                      "logit_bias", "user", "stream_options", "response_format"]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [("/v1/chat/completions", _CHAT, f) for f in _NULLABLE_SAMPLING
     + ["logprobs", "top_logprobs", "parallel_tool_calls", "tools", "tool_choice",
        "max_completion_tokens", "max_tokens", "reasoning_effort"]]
    + [("/v1/completions", _COMPLETION, f) for f in _NULLABLE_SAMPLING
       + ["echo", "logprobs", "best_of", "suffix"]],
)  # fmt: skip
def test_null_in_a_nullable_field_is_not_given(
    route: str, body: dict[str, Any], field: str
) -> None:
    # OpenAI's schema makes them nullable and clients send null for unset values (vLLM: 200).
    client = TestClient(make_openai_app(_PayloadOnly()))  # type: ignore[arg-type]
    response = client.post(route, json={**body, field: None})
    assert response.status_code == 200, response.text
    assert response.json() == client.post(route, json=body).json()


def test_null_means_the_default_not_none() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            **_CHAT,
            "temperature": None,
            "n": None,
            "stream": None,
            "parallel_tool_calls": None,
            "stream_options": {"include_usage": None},
        }
    )
    assert (req.temperature, req.n, req.stream, req.parallel_tool_calls) == (1.0, 1, False, True)
    assert "temperature" not in req.model_fields_set
    completion = CompletionRequest.model_validate({**_COMPLETION, "echo": None})
    assert completion.echo is False
    # A required field stays required, a non-nullable one keeps its type check.
    for bad in ({**_CHAT, "model": None}, {**_CHAT, "ignore_eos": None}):
        with pytest.raises(ValueError):
            ChatCompletionRequest.model_validate(bad)


def test_temperature_above_2_is_400_naming_it() -> None:
    # vLLM's range (OpenAI's "between 0 and 2"); the schema states it too.
    SamplingParams(temperature=2.0)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(temperature=2.5)
    assert info.value.param == "temperature" and "[0, 2]" in str(info.value)
    prop = ChatCompletionRequest.model_json_schema()["properties"]["temperature"]
    assert prop["maximum"] == 2


def _stopped(chat: bool, **kw: Any) -> Completion:
    completion = Completion("m", chat=chat, include_usage=False, **kw)
    completion.absorb(StreamStart(3, 1))
    return completion


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("reason", ["e", 97, None])
def test_stop_reason_is_in_whole_choices_and_the_finishing_chunk(
    chat: bool, reason: str | int | None
) -> None:
    """vLLM's ``stop_reason``: the stop string or stop token id that matched (None for EOS)."""
    completion = _stopped(chat)
    first = completion.absorb(StreamDelta([ChoiceDelta(0, "ab", [1], None, None, None, 1)]))
    last = completion.absorb(StreamDelta([ChoiceDelta(0, "c", [2], None, "stop", reason, 2)]))
    chunks = [completion.chunk(c)["choices"][0] for c in first + last]
    assert [c["stop_reason"] for c in chunks] == [None, reason]
    assert completion.whole()["choices"][0]["stop_reason"] == reason


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk() -> None:
    req = CompletionRequest(model="m", prompt="x", stream=True,
                            stream_options={"include_usage": True,
                                            "continuous_usage_stats": True})  # fmt: skip
    assert openai_payloads.stream_usage(req) == (True, True)
    # vLLM: only with include_usage.
    alone = req.model_copy(update={"stream_options": req.stream_options.model_copy(
        update={"include_usage": False})})  # fmt: skip
    assert openai_payloads.stream_usage(alone) == (False, False)
    completion = Completion("m", chat=True, include_usage=True, continuous_usage=True)
    completion.absorb(StreamStart(4, 2))
    items = [delta(0, "a", 1), delta(1, "b", 1), delta(0, "c", 2, "length")]
    usages = [completion.chunk(c)["usage"] for item in items for c in completion.absorb(item)]
    assert [(u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) for u in usages] == [
        (4, 1, 5), (4, 1, 5), (4, 2, 6)
    ]  # fmt: skip
    assert completion.usage_chunk()["usage"]["completion_tokens"] == 3
    plain_usage = Completion("m", chat=True, include_usage=True)
    plain_usage.absorb(StreamStart(4, 1))
    (choice,) = plain_usage.absorb(delta(0, "a", 1))
    assert plain_usage.chunk(choice)["usage"] is None


def test_add_generation_prompt_false_reaches_the_server() -> None:
    req = ChatCompletionRequest(**_CHAT, add_generation_prompt=False)
    assert chat_payload(req)["add_generation_prompt"] is False
    assert "add_generation_prompt" not in chat_payload(ChatCompletionRequest(**_CHAT))
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]
    both = ChatCompletionRequest(model="m", messages=prefill, continue_final_message=True,
                                 add_generation_prompt=True)  # fmt: skip
    with pytest.raises(APIError) as info:
        chat_payload(both)
    assert (info.value.status, info.value.param) == (400, "add_generation_prompt")


def test_tokenize_request_carries_vllms_options() -> None:
    from cluster.api.openai_models import TokenizeRequest

    req = TokenizeRequest(prompt="hi", add_special_tokens=False)  # model may be left out
    assert plain(openai_payloads.tokenize_payload(req)) == {
        "prompt": "hi", "add_special_tokens": False}  # fmt: skip
    chat = TokenizeRequest(messages=[{"role": "user", "content": "hi"}],
                           add_generation_prompt=False)  # fmt: skip
    payload = plain(openai_payloads.tokenize_payload(chat))
    assert payload["add_generation_prompt"] is False and "add_special_tokens" not in payload


def test_tokenizer_routes_without_a_model_use_the_only_one() -> None:
    from types import SimpleNamespace

    from cluster.serving.ingress import OpenAIIngress

    one = SimpleNamespace(servers={"tiny": None})
    assert OpenAIIngress._tokenizer_model(one, None) == "tiny"  # type: ignore[arg-type]
    two = SimpleNamespace(servers={"a": None, "b": None})
    with pytest.raises(APIError) as info:
        OpenAIIngress._tokenizer_model(two, None)  # type: ignore[arg-type]
    assert (info.value.status, info.value.param) == (400, "model")


NAMED = {"type": "function", "function": {"name": "get_weather"}}
FORCED_CUTS = [  # tool_choice, the output's pieces up to where max_tokens cut it
    ("required", ['[{"name": "get', "_wea"]),  # in the name
    ("required", ['[{"name": "get_weather", ', '"parameters": {"ci']),  # the call announced
    ("required", ['[{"name": "get_weather", "parameters": {}}', ", "]),  # after a whole call
    (NAMED, ['{"city": ', '"Os']),  # in the arguments
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("tool_choice", "pieces"), FORCED_CUTS)
def test_forced_call_cut_off_by_max_tokens_returns_the_text_as_content(
    stream: bool, tool_choice: Any, pieces: list[str]
) -> None:
    # vLLM returns what was generated rather than nothing (or arguments that are no JSON); a
    # stream holds the call back until the output ends, so it says the same as a whole one.
    completion = _tool_completion(_tool_request(tool_choice=tool_choice), stream, None)
    chunks = _feed(completion, pieces, finish="length")
    if stream:
        content = "".join(c["delta"].get("content") or "" for c in chunks)
        assert content == "".join(pieces)
        assert not [c for c in chunks if c["delta"].get("tool_calls")]
        assert chunks[-1]["finish_reason"] == "length"
    else:
        choice = completion.whole()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": "".join(pieces)}
        assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_forced_output_that_is_no_json_is_content_never_dropped(
    tool_choice: Any, stream: bool
) -> None:
    """Output that is no whole JSON value at its end (text outside what the grammar
    constrained) is returned as content, not read as no call and lost."""
    completion = _tool_completion(_tool_request(tool_choice=tool_choice), stream, None)
    chunks = _feed(completion, ["over", '[{"name": "get_weather", "parameters": {}}]'])
    if stream:
        assert "".join(c["delta"].get("content") or "" for c in chunks).startswith("over[")
        assert not [c for c in chunks if c["delta"].get("tool_calls")]
    else:
        message = completion.whole()["choices"][0]["message"]
        assert message["content"].startswith("over[") and "tool_calls" not in message


def test_a_streamed_forced_call_comes_whole_when_the_output_ends() -> None:
    """Its deltas wait for the last step; every step before still sends its tokens' logprobs,
    which add up to the whole response's."""
    steps = ['{"city": ', '"Oslo"', "}"]
    req = _tool_request(tool_choice=NAMED, logprobs=True, top_logprobs=1)
    tools = openai_payloads.tool_choice(req)
    completion = Completion("m", True, False, 1, tools=tools, stream=True)
    completion.absorb(StreamStart(5, 1))
    chunks = [
        completion.absorb(delta(0, text, i + 1, finish, logprobs=[LOGPROBS[0]]))
        for i, (text, finish) in enumerate(zip(steps, [None, None, "stop"]))
    ]
    assert not [c for step in chunks[:2] for c in step if c["delta"].get("tool_calls")]
    calls = [call for c in chunks[2] for call in c["delta"]["tool_calls"]]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(call["function"].get("arguments", "") for call in calls) == "".join(steps)
    assert chunks[2][-1]["finish_reason"] == "stop"
    streamed = [row for step in chunks for c in step if c["logprobs"]
                for row in c["logprobs"]["content"]]  # fmt: skip
    assert (
        len(streamed) == 3 and streamed == completion.whole()["choices"][0]["logprobs"]["content"]
    )


def test_forced_call_that_ends_at_max_tokens_is_still_a_call() -> None:
    req = _tool_request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    completion = _tool_completion(req, False, None)
    _feed(completion, ['{"city": ', '"Oslo"}'], finish="length")
    message = completion.whole()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


# ---- prompt_logprobs (vLLM's) ----


@pytest.mark.parametrize("chat", [True, False])
def test_prompt_logprobs_reach_the_engine_by_name(chat: bool) -> None:
    req = _request(chat, prompt_logprobs=2)
    assert _payload(chat, req)["params"]["prompt_logprobs"] == 2


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_prompt_logprobs_are_400_naming_them_as_in_vllm(chat: bool) -> None:
    with pytest.raises(APIError) as info:
        _payload(chat, _request(chat, prompt_logprobs=1, stream=True))
    assert (info.value.status, info.value.param) == (400, "prompt_logprobs")
    # 0 is accepted (vLLM's rule) and, as no chunk carries them, not computed.
    assert "prompt_logprobs" not in _payload(chat, _request(chat, prompt_logprobs=0,
                                                            stream=True))["params"]  # fmt: skip


def test_echo_scores_the_prompt_with_the_requests_prompt_logprobs_when_given() -> None:
    req = CompletionRequest(model="m", prompt="x", echo=True, logprobs=1, prompt_logprobs=3)
    assert completion_payload(req)["params"]["prompt_logprobs"] == 3
    echo_only = CompletionRequest(model="m", prompt="x", echo=True, logprobs=1)
    assert completion_payload(echo_only)["params"]["prompt_logprobs"] == 1


# A two-token prompt's entries as StreamStart carries them: the first token has no logprob;
# the second is scored with the top 2 ("b" at rank 3, below them).
PROMPT_ENTRIES = [[[4, "a", None, None]], [[8, "b", -3.0, 3], [7, "y", -0.2, 1], [9, "w", -2.0, 2]]]
VLLM_PROMPT_LOGPROBS = [
    None,
    {
        "8": {"logprob": -3.0, "rank": 3, "decoded_token": "b"},
        "7": {"logprob": -0.2, "rank": 1, "decoded_token": "y"},
        "9": {"logprob": -2.0, "rank": 2, "decoded_token": "w"},
    },
]


def test_completion_prompt_logprobs_are_on_each_choice_in_vllms_shape() -> None:
    completion = Completion("m", chat=False, include_usage=False)
    completion.absorb(StreamStart(2, 2, prompt_logprobs=PROMPT_ENTRIES))
    completion.absorb(StreamDelta([ChoiceDelta(i, "c", [1], None, "length", None, 1)
                                   for i in range(2)]))  # fmt: skip
    whole = completion.whole()
    assert [c["prompt_logprobs"] for c in whole["choices"]] == [VLLM_PROMPT_LOGPROBS] * 2
    assert "prompt_logprobs" not in whole


def test_chat_prompt_logprobs_are_on_the_response_in_vllms_shape() -> None:
    completion = Completion("m", chat=True, include_usage=False)
    completion.absorb(StreamStart(2, 1, prompt_logprobs=PROMPT_ENTRIES))
    completion.absorb(StreamDelta([ChoiceDelta(0, "c", [1], None, "length", None, 1)]))
    whole = completion.whole()
    assert whole["prompt_logprobs"] == VLLM_PROMPT_LOGPROBS
    assert "prompt_logprobs" not in whole["choices"][0]


def test_echoed_prompt_has_logprobs_top_alternatives_whatever_prompt_logprobs_asked() -> None:
    # vLLM: the echoed tokens list the token and the top ``logprobs`` (here 1) alternatives.
    completion = Completion("m", chat=False, include_usage=False, top_logprobs=1, echo=True)
    completion.absorb(StreamStart(2, 1, "ab", prompt_logprobs=PROMPT_ENTRIES))
    completion.absorb(StreamDelta([ChoiceDelta(0, "c", [1], None, "length", None, 1)]))
    choice = completion.whole()["choices"][0]
    assert choice["logprobs"]["top_logprobs"] == [None, {"b": -3.0, "y": -0.2}]
    assert choice["prompt_logprobs"] == VLLM_PROMPT_LOGPROBS


def _request(chat: bool, **fields: Any) -> Any:
    if chat:
        return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                     **fields)  # fmt: skip
    return CompletionRequest(model="m", prompt="x", **fields)


def _payload(chat: bool, req: Any) -> dict[str, Any]:
    return chat_payload(req) if chat else completion_payload(req)


# ---- chat echo (vLLM's) ----

PREFILL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the"}]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_starts_the_answer_with_the_last_assistant_message(stream: bool) -> None:
    req = ChatCompletionRequest(
        model="m", messages=PREFILL, echo=True, stream=stream, add_generation_prompt=False,
        continue_final_message=True,
    )  # fmt: skip
    echo = openai_payloads.chat_echo(req)
    completion = Completion("m", True, False, stream=stream, chat_echo=echo)
    chunks = completion.absorb(StreamStart(5, 1)) + _feed(completion, [" cat", " sat"])
    if stream:
        assert "".join(c["delta"].get("content") or "" for c in chunks) == "Sure, the cat sat"
        assert [c["delta"].get("role") for c in chunks] == ["assistant", None, None]
    else:
        message = completion.whole()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "Sure, the cat sat"}


def test_chat_echo_is_the_last_message_only_when_it_has_the_answers_role() -> None:
    def echo(messages: list[dict[str, Any]], **fields: Any) -> str:
        req = ChatCompletionRequest(model="m", messages=messages, **fields)
        return openai_payloads.chat_echo(req)

    assert echo(PREFILL) == ""  # echo not asked
    assert echo(PREFILL, echo=True) == "Sure, the"
    user_last = [{"role": "user", "content": "hi"}]
    assert echo(user_last, echo=True) == ""  # the answer is the assistant's
    # Without the generation prompt the answer continues the last message, in its role.
    assert echo(user_last, echo=True, add_generation_prompt=False) == "hi"
    # Its text as the template gets it: text-like parts one a line, null texts skipped.
    parts = [{"type": "text", "text": "a"}, {"type": "output_text", "text": "b"},
             {"type": "text", "text": None}, {"type": "refusal", "refusal": "c"}]  # fmt: skip
    assert echo([{"role": "assistant", "content": parts}], echo=True) == "a\nb\nc"
    assert echo([{"role": "assistant", "content": None}], echo=True) == ""
