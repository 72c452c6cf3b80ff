"""Pooling models through ``cluster serve``'s application on a local Ray, one deployment of
three models: a Qwen3-Reranker-style cross-encoder (a causal LM with ``hf_overrides``), a
sequence classifier with labels, and a Qwen3-Embedding-layout model (``runner: pooling``,
Matryoshka sizes). Checked against HF transformers (fp32, same weights): ``/v1/rerank`` through
the official ``cohere`` client and as Jina's shape, ``/score``, ``/classify``, and
``/v1/embeddings`` through the official ``openai`` client (``dimensions``, base64); errors are
400s naming the field, and the server keeps serving."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import cohere
import httpx
import numpy as np
import pytest
import torch
from openai import BadRequestError, OpenAI
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

from engine.builtin.catalog import resolve_model_source
from tests.cluster.conftest import ServeCluster, load_yaml

APP = "pooling"
RERANKER, CLASSIFIER, EMBEDDER = "reranker", "classifier", "embedder"
RERANK_TOKENS = ["Ġno", "Ġthe"]  # stand-ins for Qwen3-Reranker's "no" / "yes"
QUERY = "what is the capital of france"
DOCS = ["bananas are yellow", "the capital of france is paris", "paris", "a small dog barks"]
ATOL = 1e-4
ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 512, "num_kv_blocks": 64,
          "max_num_batched_tokens": 32}  # fmt: skip


def model_entry(model_id: str, source: str, **engine_kwargs: Any) -> dict[str, Any]:
    return {
        "model_loading_config": {"model_id": model_id, "model_source": source},
        "engine_kwargs": {**ENGINE, **engine_kwargs},
        "deployment_config": {"num_replicas": 1, "max_ongoing_requests": 32},
    }


@pytest.fixture(scope="module")
def base_url(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    reranker = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": RERANK_TOKENS,
        "is_original_qwen3_reranker": True,
    }
    config = {
        **load_yaml("tiny.yaml"),
        "models": [
            model_entry(RERANKER, "builtin:tiny-qwen3", hf_overrides=reranker),
            model_entry(CLASSIFIER, "builtin:tiny-qwen3-classifier"),
            model_entry(
                EMBEDDER,
                "builtin:tiny-qwen3-embedding",
                runner="pooling",
                hf_overrides={"matryoshka_dimensions": [16, 32]},
            ),
        ],
    }
    url = serve_cluster.deploy(config, APP, f"/{APP}")
    yield url
    serve.delete(APP)


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


def hf_rerank_scores(query: str, docs: list[str]) -> list[float]:
    path = resolve_model_source("builtin:tiny-qwen3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.convert_tokens_to_ids(RERANK_TOKENS)
    scores = []
    for doc in docs:
        prompt = tokenizer(text=query + doc)["input_ids"]  # vLLM's rule for a converted LM
        with torch.no_grad():
            last = model(torch.tensor([prompt])).logits[0, -1]
        scores.append(torch.softmax(last[ids], 0)[1].item())
    return scores


def test_rerank_through_the_cohere_client_orders_as_hf(base_url: str) -> None:
    expected = hf_rerank_scores(QUERY, DOCS)
    client = cohere.ClientV2(api_key="unused", base_url=base_url)
    reply = client.rerank(model=RERANKER, query=QUERY, documents=DOCS, top_n=3)
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])[:3]
    assert [r.index for r in reply.results] == order
    for r in reply.results:
        assert abs(r.relevance_score - expected[r.index]) < ATOL


def test_rerank_jina_shape_and_score_pairs(http: httpx.Client) -> None:
    expected = hf_rerank_scores(QUERY, DOCS)
    body = {"model": RERANKER, "query": QUERY, "documents": [{"text": d} for d in DOCS]}
    reply = http.post("/v1/rerank", json=body)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -expected[i])
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in results)
    assert reply.json()["usage"]["total_tokens"] > 0
    score = http.post("/score", json={"model": RERANKER, "text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in score["data"]] == list(range(len(DOCS)))
    assert np.allclose([d["score"] for d in score["data"]], expected, atol=ATOL)
    # text_1 and text_2 lists of the same length pair up position by position.
    pairs = http.post("/v1/score", json={"model": RERANKER, "text_1": [QUERY, QUERY],
                                         "text_2": DOCS[:2]}).json()  # fmt: skip
    assert np.allclose([d["score"] for d in pairs["data"]], expected[:2], atol=ATOL)


def test_classify_matches_hf_with_labels(http: httpx.Client) -> None:
    path = resolve_model_source("builtin:tiny-qwen3-classifier")
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = ["a short text", "a rather longer text that spans more than one step of the budget"]
    reply = http.post("/classify", json={"model": CLASSIFIER, "input": texts})
    assert reply.status_code == 200, reply.text
    for text, item in zip(texts, reply.json()["data"], strict=True):
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([tokenizer(text)["input_ids"]])).logits[0], 0)
        assert np.allclose(item["probs"], probs.numpy(), atol=ATOL)
        assert item["label"] == model.config.id2label[int(probs.argmax())]
        assert item["num_classes"] == 3


def test_embeddings_with_dimensions_through_the_openai_client(base_url: str) -> None:
    path = resolve_model_source("builtin:tiny-qwen3-embedding")
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    texts = ["Instruct: find the capital\nQuery:france", "paris is the capital"]
    reply = client.embeddings.create(model=EMBEDDER, input=texts, dimensions=16)
    raw = client.embeddings.create(model=EMBEDDER, input=texts, encoding_format="base64")
    for i, text in enumerate(texts):
        with torch.no_grad():
            last = model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0, -1]
        short = torch.nn.functional.normalize(last[:16], dim=0).numpy()
        assert np.allclose(reply.data[i].embedding, short, atol=ATOL)
        data = raw.data[i].embedding
        vector = np.frombuffer(base64.b64decode(data), "<f4") if isinstance(data, str) else data
        assert np.allclose(vector, torch.nn.functional.normalize(last, dim=0).numpy(), atol=ATOL)
    with pytest.raises(BadRequestError, match="one of") as err:
        client.embeddings.create(model=EMBEDDER, input="x", dimensions=24)
    assert err.value.body["param"] == "dimensions"  # type: ignore[index]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/score", {"model": CLASSIFIER, "text_1": "a", "text_2": "b"}, "model"),  # 3 classes
        ("/classify", {"model": EMBEDDER, "input": "a"}, "task"),
        ("/score", {"model": RERANKER, "text_1": ["a", "b"], "text_2": ["c"] * 3}, "text_2"),
        ("/rerank", {"model": RERANKER, "query": "q", "documents": []}, "documents"),
        (
            "/v1/chat/completions",
            {"model": RERANKER, "messages": [{"role": "user", "content": "hi"}]},
            "model",
        ),
        ("/rerank", {"model": "nope", "query": "q", "documents": ["d"]}, "model"),
    ],
)
def test_bad_requests_are_named_and_the_server_keeps_serving(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    reply = http.post(path, json=body)
    assert reply.status_code == (404 if body["model"] == "nope" else 400), reply.text
    assert reply.json()["error"]["param"] == param
    ok = http.post("/score", json={"model": RERANKER, "text_1": "a", "text_2": "b"})
    assert ok.status_code == 200


pytestmark = pytest.mark.slow
