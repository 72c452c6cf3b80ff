"""The prompt's tokens read from the prefix cache, in usage, as vLLM reports them: with a model's
``enable_prompt_tokens_details``, chat and completions usage carry
``prompt_tokens_details.cached_tokens`` and Messages usage ``cache_read_input_tokens`` (its
``input_tokens`` then the rest); Responses usage always carries
``input_tokens_details.cached_tokens``. configs/tiny.yaml on a local Ray, twice: with the option
and without it, through the official ``openai`` and ``anthropic`` clients. A repeated prompt
reads every full block but the one holding its last token (block size 16)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from anthropic import Anthropic
from openai import OpenAI

from tests.cluster.conftest import ServeCluster, load_yaml, prompt_tokens

APP = "cached"
DETAILED, PLAIN = "tiny-detailed", "tiny-plain"
BLOCK = 16
ASK = [{"role": "user", "content": " ".join(f"word{i}" for i in range(60))}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_url(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    from cluster.serving.responses_store import remove_store

    config = load_yaml("tiny.yaml")
    detailed = config["models"][0]
    detailed["model_loading_config"]["model_id"] = DETAILED
    detailed["engine_kwargs"]["enable_prompt_tokens_details"] = True
    plain = {
        **detailed,
        "model_loading_config": {**detailed["model_loading_config"], "model_id": PLAIN},
        "engine_kwargs": {**detailed["engine_kwargs"], "enable_prompt_tokens_details": False},
    }
    config["models"].append(plain)  # fmt: skip
    yield serve_cluster.deploy(config, APP, f"/{APP}")
    serve.delete(APP)
    remove_store(APP)


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _cached(base_url: str, model: str) -> int:
    """What a repeat of ``ASK`` reads from the cache: its full blocks but the last token's."""
    return (prompt_tokens(base_url, ASK, model) - 1) // BLOCK * BLOCK


def test_chat_and_completions_usage_name_the_cached_tokens(base_url: str, client: OpenAI) -> None:
    first = client.chat.completions.create(model=DETAILED, messages=ASK, max_tokens=2)
    again = client.chat.completions.create(model=DETAILED, messages=ASK, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = _cached(base_url, DETAILED)
    assert cached >= 3 * BLOCK  # the case this test is about
    assert again.usage.prompt_tokens_details.cached_tokens == cached
    # Streamed, in the usage chunk.
    chunks = list(client.chat.completions.create(
        model=DETAILED, messages=ASK, max_tokens=2, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    # Completions: the prompts' sum (two prompts, each a repeat).
    text = ASK[0]["content"] + " x"
    client.completions.create(model=DETAILED, prompt=text, max_tokens=1)
    both = client.completions.create(model=DETAILED, prompt=[text, text], max_tokens=1)
    one = (both.usage.prompt_tokens // 2 - 1) // BLOCK * BLOCK
    assert both.usage.prompt_tokens_details.cached_tokens == 2 * one
    # Without the option, as vLLM: no details.
    client.chat.completions.create(model=PLAIN, messages=ASK, max_tokens=2)
    plain = client.chat.completions.create(model=PLAIN, messages=ASK, max_tokens=2)
    assert plain.usage.prompt_tokens_details is None


def test_responses_usage_always_names_them(base_url: str, client: OpenAI) -> None:
    client.chat.completions.create(model=PLAIN, messages=ASK, max_tokens=2)  # cached now
    response = client.responses.create(model=PLAIN, input=ASK, max_output_tokens=2, store=False)
    assert response.usage.input_tokens_details.cached_tokens == _cached(base_url, PLAIN)


def test_messages_usage_reads_them_out_of_the_input_tokens(base_url: str) -> None:
    client = Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    total = prompt_tokens(base_url, ASK, DETAILED)
    client.messages.create(model=DETAILED, messages=ASK, max_tokens=2)  # cached now
    message = client.messages.create(model=DETAILED, messages=ASK, max_tokens=2)
    cached = _cached(base_url, DETAILED)
    assert message.usage.cache_read_input_tokens == cached
    assert message.usage.input_tokens == total - cached
    plain = client.messages.create(model=PLAIN, messages=ASK, max_tokens=2)
    assert plain.usage.cache_read_input_tokens is None and plain.usage.input_tokens == total
