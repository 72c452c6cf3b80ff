"""Every model family at TP = 2 (and one at TP 2 x PP 2, DeepSeek-V3 at PP 2 and EP 2) equals
TP = 1, on CPU with gloo and a local Ray: KV heads split or replicated (Gemma 3's single KV
head, DeepSeek's latent), per-head q/k norms, soft-caps, windows shorter than the prompts,
partial rotary and fused checkpoint tensors, all read from each rank's shard. TP = 1 itself is
checked against HF in test_correctness (test_moe for DeepSeek)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_models import tiny_variant

GREEDY = SamplingParams(temperature=0, max_tokens=16)
ENGINE_ARGS: dict[str, Any] = {
    "num_kv_blocks": 96,
    "max_num_batched_tokens": 48,
    "enable_chunked_prefill": True,
    "max_model_len": 256,
    "device": "cpu",
}
MODELS = {
    "tiny-qwen3": lambda: resolve_model_source("builtin:tiny-qwen3"),
    "tiny-gemma2": lambda: resolve_model_source("builtin:tiny-gemma2"),
    "tiny-gemma3": lambda: resolve_model_source("builtin:tiny-gemma3"),
    "tiny-phi3": lambda: resolve_model_source("builtin:tiny-phi3"),
    "llama-biases": lambda: tiny_variant("tiny-llama", attention_bias=True, mlp_bias=True),
    "mistral-window-48": lambda: tiny_variant("tiny-mistral", sliding_window=48),
    "tiny-deepseek-v3": lambda: resolve_model_source("builtin:tiny-deepseek-v3"),
    "tiny-deepseek-v2": lambda: resolve_model_source("builtin:tiny-deepseek-v2"),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(5, 1024) for _ in range(n)] for n in (3, 30, 75, 120, 200)]


def _greedy(model: str, **args: Any) -> list[list[int]]:
    llm = LLM(str(MODELS[model]()), **ENGINE_ARGS, **args)
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False
        )
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_tp2_equals_tp1(model: str) -> None:
    expected = _greedy(model, distributed_executor_backend="uni")
    assert _greedy(model, tensor_parallel_size=2) == expected


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-deepseek-v2"])
@pytest.mark.parametrize(
    "args",
    [
        {"pipeline_parallel_size": 2},
        {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    ],
    ids=["pp2", "ep2"],
)
def test_deepseek_pp2_and_ep2_equal_tp1(model: str, args: dict[str, Any]) -> None:
    # V3: stage 0 holds the dense layer 0 and the sparse layer 1, stage 1 the last sparse
    # layer; V2-Lite's shape has no q_lora and greedy softmax routing. Latent caches on both
    # stages; EP splits the experts between the ranks, attention heads TP.
    expected = _greedy(model, distributed_executor_backend="uni")
    assert _greedy(model, **args) == expected


@pytest.mark.slow
def test_gemma2_tp2_pp2_equals_tp1() -> None:
    # Gemma's layer hands (mlp branch, stream) to the next stage like Llama's (hidden, residual).
    expected = _greedy("tiny-gemma2", distributed_executor_backend="uni")
    assert _greedy("tiny-gemma2", tensor_parallel_size=2, pipeline_parallel_size=2) == expected


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = [pytest.mark.slow, pytest.mark.local_ray(num_cpus=8)]
