"""LoRA adapters through ``cluster serve``'s path on a local Ray, with the official ``openai``
client: two adapters of different ranks and target modules and the base model answer by name
(``tiny-llama:<adapter>``) exactly as the offline engine does under each adapter; ``/v1/models``
lists the adapters; an unknown adapter is a 404; with two replicas, Serve's model multiplexing
keeps an adapter's requests on the replica that loaded it (seen in the replica header and the
per-adapter metrics)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import NotFoundError, OpenAI

from cluster.serve import REPLICA_HEADER
from engine import LLM, SamplingParams
from engine.lora import LoRARequest
from engine.tiny_models import make_tiny_lora
from tests.cluster.conftest import ServeCluster, load_yaml, wait_for

APP = "lora"
MODEL = "tiny-llama"
PROMPT = "The capital of the tiny model is"
ADAPTERS = {  # name -> (rank, target modules, seed)
    "alpha": (8, ("q_proj", "v_proj", "down_proj"), 1),
    "beta": (4, ("k_proj", "o_proj", "gate_proj", "up_proj"), 2),
}
LORA_ENGINE_KWARGS = {"max_loras": 2, "max_lora_rank": 8}


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for name, (rank, modules, seed) in ADAPTERS.items():
        make_tiny_lora("tiny-llama", root / name, rank=rank, target_modules=modules, seed=seed)
    return root


@pytest.fixture(scope="module")
def base_url(serve_cluster: ServeCluster, adapter_dir: Path) -> Iterator[str]:
    from ray import serve

    config = load_yaml("tiny.yaml")
    model = config["models"][0]
    model["engine_kwargs"].update(LORA_ENGINE_KWARGS)
    model["deployment_config"]["num_replicas"] = 2
    model["lora_config"] = {"dynamic_lora_loading_path": str(adapter_dir),
                            "max_num_adapters_per_replica": 2}  # fmt: skip
    url = serve_cluster.deploy(config, APP, "/lora")
    yield url
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(adapter_dir: Path) -> Any:
    engine_kwargs = load_yaml("tiny.yaml")["models"][0]["engine_kwargs"]
    llm = LLM("builtin:tiny-llama", **{**engine_kwargs, **LORA_ENGINE_KWARGS, "enable_lora": True})

    def greedy(adapter: str | None) -> str:
        lora = None
        if adapter is not None:
            lora = LoRARequest(
                adapter, 1 + list(ADAPTERS).index(adapter), str(adapter_dir / adapter)
            )
        params = SamplingParams(temperature=0, max_tokens=16)
        return llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text

    return greedy


def test_adapters_and_the_base_answer_by_name_like_the_offline_engine(
    client: OpenAI, offline: Any
) -> None:
    texts = {}
    for name in (None, "alpha", "beta"):
        model = MODEL if name is None else f"{MODEL}:{name}"
        response = client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                             temperature=0)  # fmt: skip
        assert response.model == model
        texts[name] = response.choices[0].text
        assert texts[name] == offline(name), name
    assert len(set(texts.values())) == 3  # each adapter changes the output


def test_streamed_chat_with_an_adapter(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(
        model=f"{MODEL}:beta", messages=messages, max_tokens=8, temperature=0
    )
    stream = client.chat.completions.create(
        model=f"{MODEL}:beta", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


def test_models_list_the_adapters_and_unknown_ones_are_404(client: OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, f"{MODEL}:alpha", f"{MODEL}:beta"]
    assert client.models.retrieve(f"{MODEL}:alpha").id == f"{MODEL}:alpha"
    for missing in (f"{MODEL}:gamma", f"{MODEL}:..", "other:alpha"):
        with pytest.raises(NotFoundError):
            client.completions.create(model=missing, prompt="x", max_tokens=2)
    with pytest.raises(NotFoundError):
        client.models.retrieve(f"{MODEL}:gamma")


def _replica(client: OpenAI, model: str, prompt: str = PROMPT) -> str:
    raw = client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=2, temperature=0
    )
    return raw.headers[REPLICA_HEADER]


def test_multiplexing_keeps_an_adapters_requests_on_the_replica_that_loaded_it(
    client: OpenAI, base_url: str
) -> None:
    # Unrelated prompts of the base model spread over both replicas (the prefix-aware router
    # sends a prompt it has no history for to the least-loaded one).
    prompts = [
        f"{word} is a word of the story number {i}"
        for i, word in enumerate(
            ["Apple", "River", "Stone", "Cloud", "Lemon", "Tiger", "Ocean", "Maple"]
        )
    ]
    assert len({_replica(client, MODEL, p) for p in prompts}) == 2  # fmt: skip
    for name in ADAPTERS:
        # A fresh client per adapter: Serve routes by multiplexed model id once the replica
        # that loaded it has reported it (pushed every few tenths of a second).
        first = _replica(client, f"{MODEL}:{name}")
        time.sleep(2.0)
        assert {_replica(client, f"{MODEL}:{name}") for _ in range(8)} == {first}, name


def test_per_adapter_metrics(client: OpenAI, base_url: str) -> None:
    _replica(client, f"{MODEL}:alpha")

    def scraped() -> bool:
        text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
        lines = [line for line in text.splitlines() if "lora_requests_total" in line]
        return any('adapter="alpha"' in line for line in lines) and any(
            "lora_generation_tokens_total" in line and 'adapter="alpha"' in line
            for line in text.splitlines()
        )

    wait_for(scraped, timeout_s=30, what="per-adapter metrics in /metrics", poll_s=2)
