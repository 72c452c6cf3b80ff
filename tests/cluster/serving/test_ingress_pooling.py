"""The pooling routes of the ingress (``cluster.serving.ingress_pooling``) over a recording
server, through the real HTTP routes and the ingress's routing (no engine, no Ray): what reaches
the server for each field, the fields that are a 400 naming them, and a LoRA adapter's name (a
400: the engine pools under the base model only; an unknown one a 404)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from ray.serve.exceptions import BackPressureError

from cluster.api.openai_api import make_openai_app
from cluster.api.replica_messages import (
    EmbedRequest,
    EmbedResult,
    ScoreRequest,
    ScoreResult,
    StreamError,
)
from cluster.serving.ingress_pooling import PoolingServicer
from tests.cluster.serving.routed_ingress import Method, RoutedIngress


def _embedded(request: EmbedRequest) -> EmbedResult | StreamError:
    if request.prompt == "":  # the engine's check, as the server answers it
        return StreamError(400, "prompt: must not be empty", "prompt")
    return EmbedResult([1.0, 0.0], 3, "yes")


class _Handle:
    """A server that embeds every input as [1, 0] (an empty prompt: the engine's 400) and scores
    pairs 0.3, 0.9, 0.6."""

    def __init__(self, calls: list[Any]) -> None:
        self.embed = Method(_embedded, calls)
        scores = [0.3, 0.9, 0.6]
        self.score = Method(lambda r: ScoreResult(scores[: len(r.text_2)], 7), calls)

    def options(self, **kwargs: Any) -> _Handle:  # (a multiplexed model id: the same server)
        return self


class _Recording(RoutedIngress, PoolingServicer):
    """An ingress, with the real routing, serving model ``m`` (and its LoRA adapter ``a1``)."""

    def __init__(self) -> None:
        super().__init__(_Handle)

    async def _adapters(self, base: str) -> list[str]:
        return ["a1"]

    async def _admit(self, model: str) -> None:
        return None


@pytest.fixture
def ingress() -> _Recording:
    return _Recording()


def _post(ingress: _Recording, path: str, body: dict[str, Any]) -> Any:
    return TestClient(make_openai_app(ingress)).post(path, json=body)  # type: ignore[arg-type]


RERANK = {"model": "m", "query": "q", "documents": ["a", "b", "c"]}


@pytest.mark.parametrize(("value", "param"), [("", "input"), (["a", ""], "input.1")])
def test_an_empty_input_is_a_400_naming_it_in_the_request(
    ingress: _Recording, value: Any, param: str
) -> None:
    """The engine names its prompt; the embeddings request's field is ``input`` (an item of
    a batch: ``input.i``)."""
    response = _post(ingress, "/v1/embeddings", {"model": "m", "input": value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


BODIES = {
    "/v1/embeddings": {"model": "m", "input": "hi"},
    "/classify": {"model": "m", "input": "hi"},
    "/score": {"model": "m", "text_1": "a", "text_2": "b"},
    "/rerank": RERANK,
}


def test_rerank_top_n_below_zero_is_a_400_naming_top_n(ingress: _Recording) -> None:
    response = _post(ingress, "/rerank", {**RERANK, "top_n": -1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "top_n" and "top_n: must be >= 0" in error["message"]
    assert ingress.calls == []  # refused before any scoring


@pytest.mark.parametrize(("top_n", "indices"), [(None, [1, 2, 0]), (0, [1, 2, 0]), (2, [1, 2])])
def test_rerank_top_n_zero_or_null_keeps_every_document(
    ingress: _Recording, top_n: int | None, indices: list[int]
) -> None:
    response = _post(ingress, "/rerank", {**RERANK, "top_n": top_n})
    assert response.status_code == 200
    assert [r["index"] for r in response.json()["results"]] == indices


@pytest.mark.parametrize("field", ["truncate_prompt_tokens", "functions", "audio"])
def test_an_unsupported_field_sent_as_null_is_not_given(ingress: _Recording, field: str) -> None:
    body = {"model": "m", "input": "hello world", field: None}
    assert _post(ingress, "/v1/embeddings", body).status_code == 200


@pytest.mark.parametrize("path", ["/score", "/rerank"])
def test_an_unsupported_field_with_a_value_is_still_a_400(ingress: _Recording, path: str) -> None:
    """Truncation cuts an embedding's or a classification's input, not a scored pair."""
    body = {**BODIES[path], "truncate_prompt_tokens": 3}
    response = _post(ingress, path, body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize(("path", "sent", "expected"),
                         [("/v1/embeddings", {}, True),
                          ("/v1/embeddings", {"add_special_tokens": False}, False),
                          ("/classify", {"add_special_tokens": False}, False)])  # fmt: skip
def test_add_special_tokens_reaches_the_server(
    ingress: _Recording, path: str, sent: dict[str, Any], expected: bool
) -> None:
    body = {"model": "m", "input": ["hello", "world"], **sent}
    assert _post(ingress, path, body).status_code == 200
    assert [c.add_special_tokens for c in ingress.calls] == [expected, expected]
    assert all(isinstance(c, EmbedRequest) for c in ingress.calls)


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/embeddings", "use_activation", False),
        ("/v1/embeddings", "normalize", False),
        ("/v1/embeddings", "embed_dtype", "float16"),
        ("/v1/embeddings", "endianness", "big"),
        ("/rerank", "truncation_side", "left"),
        ("/v1/embeddings", "padding", "max_length"),
        ("/classify", "use_activation", False),
        ("/score", "use_activation", False),
        ("/score", "max_tokens_per_doc", 8),
        ("/rerank", "use_activation", False),
        ("/rerank", "max_tokens_per_query", 8),
        ("/rerank", "instruction", "Judge relevance"),
        ("/rerank", "chat_template_kwargs", {"instruction": "x"}),
    ],
)
def test_a_pooling_field_that_changes_the_output_is_a_400_naming_it(
    ingress: _Recording, path: str, field: str, value: Any
) -> None:
    response = _post(ingress, path, {**BODIES[path], field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ")
    assert ingress.calls == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("use_activation", True), ("embed_dtype", "float32"), ("endianness", "native"),
     ("padding", "do_not_pad"), ("use_activation", None), ("normalize", None)],
)  # fmt: skip
def test_a_pooling_field_at_the_servers_own_behaviour_is_accepted(
    ingress: _Recording, field: str, value: Any
) -> None:
    body = {"model": "m", "input": "hi", "encoding_format": "base64", field: value}
    assert _post(ingress, "/v1/embeddings", body).status_code == 200


def test_score_requests_reach_the_server_as_lists(ingress: _Recording) -> None:
    body = {"model": "m", "text_1": "a", "text_2": ["b", "c"], "max_tokens_per_doc": 0}
    assert _post(ingress, "/score", body).status_code == 200
    (call,) = ingress.calls
    assert isinstance(call, ScoreRequest) and (call.text_1, call.text_2) == (["a"], ["b", "c"])


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_lora_adapter_of_the_model_is_a_400_naming_it(ingress: _Recording, path: str) -> None:
    response = _post(ingress, path, {**BODIES[path], "model": "m:a1"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "model"
    assert error["message"].startswith("`m:a1` is a LoRA adapter of 'm'; the pooling routes")
    assert ingress.calls == []


@pytest.mark.parametrize("model", ["m:nope", "other", "other:a1"])
def test_an_unknown_model_or_adapter_is_a_404(ingress: _Recording, model: str) -> None:
    response = _post(ingress, "/v1/embeddings", {"model": model, "input": "hi"})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == f"The model `{model}` does not exist."


@pytest.mark.parametrize(
    ("first", "second"),
    [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")],
)
def test_score_takes_each_of_vllms_names_for_its_sides(
    ingress: _Recording, first: str, second: str
) -> None:
    response = _post(ingress, "/score", {"model": "m", first: "q", second: ["a", "b"]})
    assert response.status_code == 200
    assert [d["score"] for d in response.json()["data"]] == [0.3, 0.9]
    [call] = ingress.calls
    assert isinstance(call, ScoreRequest) and (call.text_1, call.text_2) == (["q"], ["a", "b"])


@pytest.mark.parametrize(
    ("body", "param"),
    [({"queries": "q"}, "documents"), ({"text_2": "b"}, "text_1"), ({}, "queries")],
)
def test_score_without_both_sides_is_a_400_naming_the_missing_one(
    ingress: _Recording, body: dict[str, Any], param: str
) -> None:
    response = _post(ingress, "/score", {"model": "m", **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert ingress.calls == []


def test_rerank_takes_one_bare_document_and_reports_its_prompt_tokens(
    ingress: _Recording,
) -> None:
    long = "a " * 1500  # a bare document's length is no count of documents
    response = _post(ingress, "/rerank", {"model": "m", "query": "q", "documents": long})
    assert response.status_code == 200
    body = response.json()
    assert [r["document"]["text"] for r in body["results"]] == [long]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}  # as vLLM's RerankUsage


@pytest.mark.parametrize("value", [[5, 6, 7], [[5, 6], [7]]])
def test_classify_takes_token_ids_as_the_embeddings_route_does(
    ingress: _Recording, value: list[Any]
) -> None:
    response = _post(ingress, "/classify", {"model": "m", "input": value})
    assert response.status_code == 200
    batch = value if isinstance(value[0], list) else [value]
    assert [c.prompt_token_ids for c in ingress.calls] == batch
    assert all(isinstance(c, EmbedRequest) and c.task == "classify" for c in ingress.calls)


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_full_queue_is_a_503_with_retry_after_on_every_pooling_route(path: str) -> None:
    """Serve's ``BackPressureError`` (the model's ``max_queued_requests`` reached) is not a
    ``RayError``: it was a 500 on these routes."""

    def full(request: Any) -> Any:
        raise BackPressureError(num_queued_requests=2, max_queued_requests=2)

    ingress = _Recording()
    ingress.servers["m"].embed = ingress.servers["m"].score = Method(full, [])
    response = _post(ingress, path, BODIES[path])
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "overloaded"
    assert response.headers["retry-after"] == "1"
