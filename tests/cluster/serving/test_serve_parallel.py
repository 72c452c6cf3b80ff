"""TP = 2 and PP = 2 through Serve (gloo workers, each replica's head actor driving them) give
the same greedy tokens as TP = 1, and so does a MoE model at DP = 2 (two engine cores in one
replica, the experts split over both cores' workers), for several requests in flight at once,
read with the official ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from tests.cluster.conftest import ServeCluster, load_yaml, tiny_model

APP = "parallel"
SHAPES = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
MOE_SHAPES = {
    "moe-tp1": {},
    "moe-dp2": {"data_parallel_size": 2, "enable_expert_parallel": True},
}
PROMPTS = ["Once upon a time", "The quick brown fox", "In a hole in the ground", "Hi"]


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster) -> Iterator[OpenAI]:
    from ray import serve

    config = load_yaml("tiny.yaml")
    config["models"] = [tiny_model(name, **kwargs) for name, kwargs in SHAPES.items()]
    for name, kwargs in MOE_SHAPES.items():
        model = tiny_model(name, **kwargs)
        model["model_loading_config"]["model_source"] = "builtin:tiny-qwen3-moe"
        config["models"].append(model)
    url = serve_cluster.deploy(config, APP, "/parallel")
    yield OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0)
    serve.delete(APP)


def greedy_tokens(client: OpenAI, model: str) -> list[list[str]]:
    """Each prompt's 24 greedy tokens (as the logprobs' token strings), all sent at once."""

    def one(prompt: str) -> list[str]:
        response = client.completions.create(
            model=model, prompt=prompt, max_tokens=24, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        choice = response.choices[0]
        assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == 24
        return [choice.text, *choice.logprobs.tokens]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.mark.parametrize("shape", ["tp2", "pp2"])
def test_parallel_shape_through_serve_equals_tp1(client: OpenAI, shape: str) -> None:
    assert greedy_tokens(client, shape) == greedy_tokens(client, "tp1")


def test_data_parallel_moe_through_serve_equals_tp1(client: OpenAI) -> None:
    assert greedy_tokens(client, "moe-dp2") == greedy_tokens(client, "moe-tp1")


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow
