"""The OpenAI front without Ray: request validation -> 400 naming the field, the API-key and
body-size guard, and the mapping of OpenAI fields to the engine's sampling parameters."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cluster.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_payload,
    completion_payload,
    new_app,
)

KEY = "sk-test-key"


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


def test_malformed_json_is_400(client: TestClient) -> None:
    response = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert assert_error(response, 400, None)["code"] == "invalid_json"


def test_unknown_field_is_400_naming_it(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": "m", "prompt": "x", "tempreature": 1})
    assert_error(response, 400, "tempreature")


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


def test_key_check_uses_the_scope_path_not_a_spoofable_header(keyed: TestClient) -> None:
    headers = {"x-original-uri": "/health", "x-forwarded-path": "/health"}
    response = keyed.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert_error(response, 401, None)


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


def test_chat_text_parts_are_joined_for_the_template() -> None:
    content = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": content}])
    assert chat_payload(req)["messages"] == [{"role": "user", "content": "Hello, world"}]


def test_chat_image_part_is_400_naming_it() -> None:
    content = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": content}])
    with pytest.raises(APIError) as info:
        chat_payload(req)
    assert (info.value.status, info.value.param) == (400, "messages.0.content.0")


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"n": 2}, "n"), ({"logprobs": 1}, "logprobs"), ({"echo": True}, "echo"),
     ({"presence_penalty": 0.5}, "presence_penalty"), ({"prompt": ["a", "b"]}, "prompt")],
)  # fmt: skip
def test_unsupported_fields_are_400_naming_them(fields: dict[str, Any], param: str) -> None:
    req = CompletionRequest(**{"model": "m", "prompt": "x", **fields})
    with pytest.raises(APIError) as info:
        completion_payload(req)
    assert (info.value.status, info.value.param) == (400, param)
