"""What real OpenAI clients send, against configs/tiny.yaml on a local Ray, with the official
``openai`` client: echo and prompt logprobs (checked against HF transformers in fp32), batched
prompts, model retrieval, embeddings (checked against HF hidden states), structured outputs
(checked against the JSON schema itself), tool calling, fields clients fill in that change
nothing; and the same through ``langchain-openai``."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from openai import BadRequestError, NotFoundError, OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.tiny_models import resolve_model_source
from tests.cluster.conftest import ServeCluster, load_yaml

APP = "features"
MODEL = "tiny-llama"
PROMPT = "The capital of the tiny model is"


@pytest.fixture(scope="module")
def base_url(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    url = serve_cluster.deploy(load_yaml("tiny.yaml"), APP, "/features")
    yield url
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf() -> tuple[Any, Any]:
    path = resolve_model_source("builtin:tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def hf_prompt_logprobs(hf: tuple[Any, Any], prompt: str) -> tuple[list[int], list[float]]:
    """Each prompt token's log-probability given the tokens before it (HF, fp32)."""
    model, tokenizer = hf
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = logits.log_softmax(-1)
    return ids, [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


# ---- completions: echo, prompt logprobs, batches ----


def test_echo_with_logprobs_and_no_generation_scores_the_prompt_like_hf(
    client: OpenAI, hf: tuple[Any, Any]
) -> None:
    # What lm-evaluation-harness sends for loglikelihood tasks.
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    choice = response.choices[0]
    ids, expected = hf_prompt_logprobs(hf, PROMPT)
    assert choice.text == PROMPT
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], expected, atol=1e-4)
    # The top-1 alternative (or the token itself when it is the most likely) is listed.
    assert all(len(top) in (1, 2) for top in lp.top_logprobs[1:])
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == len(ids)


def test_echo_with_generation_puts_the_prompt_first(client: OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=0
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    tokens = echoed.choices[0].logprobs.tokens
    assert len(tokens) == echoed.usage.prompt_tokens + 6
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == echoed.choices[0].text


def test_batched_prompts_are_ordered_by_prompt_then_n(client: OpenAI) -> None:
    prompts = ["Once upon a time", "The weather today", "In a hole"]
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
        for p in prompts
    ]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, single in enumerate(singles):
        assert [c.text for c in batch.choices[2 * i : 2 * i + 2]] == [single.choices[0].text] * 2
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    stream = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, temperature=0, stream=True
    )
    texts = [""] * 3
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [s.choices[0].text for s in singles]


def test_token_id_prompts_in_a_batch(client: OpenAI) -> None:
    ids = [[1, 100, 200, 300], [1, 50, 60]]
    batch = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    single = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=4, temperature=0)
    assert batch.choices[1].text == single.choices[0].text
    assert batch.usage.prompt_tokens == 7


def test_suffix_is_still_400(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", suffix="y", max_tokens=2)
    assert info.value.body["param"] == "suffix"


# ---- models, harmless fields ----


def test_models_retrieve_and_unknown_model_404(client: OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object) == (MODEL, "model")
    with pytest.raises(NotFoundError):
        client.models.retrieve("no-such-model")


def test_fields_clients_fill_in_are_accepted(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        metadata={"team": "eval"},
        store=False,
        service_tier="auto",
        extra_body={"reasoning_effort": "low", "some_future_field": 1},
    )
    assert response.choices[0].finish_reason in ("stop", "length")


def test_output_changing_unsupported_field_is_400_naming_it(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            extra_body={"functions": [{"name": "f", "parameters": {}}]},
        )
    assert info.value.body["param"] == "functions"


# ---- embeddings ----


def _hf_embedding(hf: tuple[Any, Any], text: str) -> np.ndarray:
    model, tokenizer = hf
    with torch.no_grad():
        out = model(torch.tensor([tokenizer.encode(text)]), output_hidden_states=True)
    last = out.hidden_states[-1][0, -1].float()
    return (last / last.norm()).numpy()


def test_embeddings_equal_hf_last_hidden_state_normalised(
    client: OpenAI, hf: tuple[Any, Any]
) -> None:
    texts = ["Once upon a time", "The weather today is fine"]
    response = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in response.data] == [0, 1]
    for data, text in zip(response.data, texts):
        np.testing.assert_allclose(data.embedding, _hf_embedding(hf, text), atol=1e-5)
    assert response.usage.prompt_tokens == sum(len(hf[1].encode(t)) for t in texts)


def test_embeddings_as_base64_and_from_token_ids(client: OpenAI, base_url: str) -> None:
    ids = [1, 100, 200, 300]
    floats = client.embeddings.create(model=MODEL, input=ids).data[0].embedding
    raw = client.embeddings.with_raw_response.create(
        model=MODEL, input=[ids], encoding_format="base64"
    )
    encoded = json.loads(raw.text)["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    np.testing.assert_allclose(decoded, floats, atol=1e-7)


def test_embeddings_dimensions_is_400(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="x", dimensions=8)
    assert info.value.body["param"] == "dimensions"
