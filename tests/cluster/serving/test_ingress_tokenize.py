"""``/tokenize`` and ``/detokenize`` on the ingress (``cluster.serving.ingress``) over a
recording server, through the real HTTP routes and the ingress's routing (no engine, no Ray): a
LoRA adapter's name goes to its base model's server with the adapter named (which tokenizes
with the base model's tokenizer and 404s an adapter it lacks), as the generate routes route it."""

from __future__ import annotations

from typing import Any

import pytest
import ray
from fastapi.testclient import TestClient
from ray.serve.exceptions import BackPressureError

from cluster.api.openai_api import make_openai_app
from cluster.api.replica_messages import DetokenizeResult, StreamError, TokenizeResult
from cluster.serving.ingress import OpenAIIngress
from tests.cluster.serving.routed_ingress import Method, RoutedIngress


def _not_found(adapter: str) -> StreamError:
    return StreamError(404, f"The model `m:{adapter}` does not exist.", "model", "model_not_found")


class _Handle:
    """Model ``m``'s server: it has adapter ``a1``; every prompt is the tokens [1, 2]."""

    def __init__(self, calls: list[Any]) -> None:
        def tokenize(payload: Any, strs: bool) -> Any:
            if payload.adapter not in (None, "a1"):
                return _not_found(payload.adapter)
            return TokenizeResult([1, 2], 2, 64)

        def detokenize(tokens: list[int], adapter: str | None) -> Any:
            return _not_found(adapter) if adapter not in (None, "a1") else DetokenizeResult("hi")

        self.tokenize = Method(tokenize, calls)
        self.detokenize = Method(detokenize, calls)
        self.multiplexed: list[str] = []

    def options(self, multiplexed_model_id: str) -> _Handle:
        self.multiplexed.append(multiplexed_model_id)
        return self


class _Tokenizing(RoutedIngress):
    _tokenizer_model = OpenAIIngress._tokenizer_model
    tokenize = OpenAIIngress.tokenize
    detokenize = OpenAIIngress.detokenize

    def __init__(self) -> None:
        super().__init__(_Handle)


@pytest.fixture
def ingress() -> _Tokenizing:
    return _Tokenizing()


def _post(ingress: _Tokenizing, path: str, body: dict[str, Any]) -> Any:
    return TestClient(make_openai_app(ingress)).post(path, json=body)  # type: ignore[arg-type]


def test_tokenize_with_an_adapter_reaches_the_base_models_server_naming_it(
    ingress: _Tokenizing,
) -> None:
    response = _post(ingress, "/tokenize", {"model": "m:a1", "prompt": "hello"})
    assert response.status_code == 200 and response.json()["tokens"] == [1, 2]
    ((payload, _),) = ingress.calls
    assert (payload.prompt, payload.adapter) == ("hello", "a1")
    assert ingress.servers["m"].multiplexed == ["a1"]


def test_detokenize_with_an_adapter_reaches_the_base_models_server_naming_it(
    ingress: _Tokenizing,
) -> None:
    response = _post(ingress, "/detokenize", {"model": "m:a1", "tokens": [1, 2]})
    assert response.status_code == 200 and response.json()["prompt"] == "hi"
    assert ingress.calls == [([1, 2], "a1")]


def test_the_base_model_is_served_with_no_adapter_named(ingress: _Tokenizing) -> None:
    assert _post(ingress, "/tokenize", {"model": "m", "prompt": "hello"}).status_code == 200
    assert _post(ingress, "/detokenize", {"model": "m", "tokens": [1]}).status_code == 200
    (payload, _), detokenized = ingress.calls
    assert payload.adapter is None and detokenized == ([1], None)
    assert ingress.servers["m"].multiplexed == []


BODIES = {"/tokenize": {"prompt": "hello"}, "/detokenize": {"tokens": [1]}}


@pytest.mark.parametrize(
    ("path", "model"),
    [
        ("/tokenize", "m:nope"),
        ("/detokenize", "m:nope"),
        ("/tokenize", "x:a1"),
        ("/detokenize", "x"),
    ],
)
def test_an_unknown_model_or_adapter_is_a_404(ingress: _Tokenizing, path: str, model: str) -> None:
    response = _post(ingress, path, {"model": model, **BODIES[path]})
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert error["message"] == f"The model `{model}` does not exist."


class _Refusing:
    """Model ``m``'s server when no replica takes the call: every method raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        def fail(*args: Any) -> Any:
            raise error

        self.tokenize = self.detokenize = Method(fail, [])


@pytest.mark.parametrize(
    ("error", "code", "retry_after"),
    [
        (BackPressureError(num_queued_requests=4, max_queued_requests=4), "overloaded", "1"),
        (ray.exceptions.ActorDiedError(), "unavailable", None),
    ],
)
@pytest.mark.parametrize(
    ("path", "body"),
    [("/tokenize", {"model": "m", "prompt": "hi"}), ("/detokenize", {"model": "m", "tokens": [1]})],
)
def test_a_full_queue_or_a_dead_replica_is_a_503_not_a_500(
    path: str, body: dict[str, Any], error: BaseException, code: str, retry_after: str | None
) -> None:
    """Serve's ``BackPressureError`` (the model's ``max_queued_requests`` reached) is no
    ``RayError``: it was a 500 here, where generation answers 503 with ``Retry-After``."""
    ingress = _Tokenizing()
    ingress.servers["m"] = _Refusing(error)
    response = _post(ingress, path, body)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == code
    assert response.headers.get("retry-after") == retry_after
