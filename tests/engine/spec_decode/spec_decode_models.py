"""The model and proposer config the speculative-decoding tests share: a small random Llama
whose greedy outputs fall into loops (HF's 0.02 init, vocabulary 256), so n-gram prompt lookup
proposes tokens the target really emits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import LLM, SamplingParams
from engine.builtin.catalog import make_tiny_lora
from engine.builtin.tiny_models import make_random_model
from engine.lora_request import LoRARequest

VOCAB = 256


def make_looping_model(
    path: Path, max_position_embeddings: int = 256, num_hidden_layers: int = 2
) -> Path:
    return make_random_model(
        path,
        hidden_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=max_position_embeddings,
    )


def ngram(k: int) -> dict[str, Any]:
    """vLLM's n-gram ``speculative_config`` proposing ``k`` tokens from 1- to 3-gram matches."""
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }


def make_small_draft(
    path: Path, num_key_value_heads: int, seed: int, max_position_embeddings: int
) -> Path:
    """A draft much smaller than the looping model, with its vocabulary (and so its tokenizer)."""
    return make_random_model(
        path,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=64,
        seed=seed,
        vocab_size=VOCAB,
        max_position_embeddings=max_position_embeddings,
    )


def draft(path: Path, k: int) -> dict[str, Any]:
    """vLLM's draft-model ``speculative_config``: ``path`` proposes ``k`` tokens."""
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def generate(
    llm: LLM,
    params: SamplingParams,
    prompts: list[list[int]],
    lora_request: list[LoRARequest | None] | None = None,
) -> list[list[int]]:
    """Every choice's token ids, request by request."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=lora_request)  # fmt: skip
    return [list(c.token_ids) for o in outs for c in o.outputs]


def generator(
    default_params: SamplingParams, default_prompts: list[list[int]]
) -> Callable[..., list[list[int]]]:
    """``generate`` with a test module's own default params and prompts."""

    def run(
        llm: LLM,
        params: SamplingParams = default_params,
        prompts: list[list[int]] = default_prompts,
        lora_request: list[LoRARequest | None] | None = None,
    ) -> list[list[int]]:
        return generate(llm, params, prompts, lora_request)

    return run


def alternating_adapters(model: Path, tmp_path: Path, num_prompts: int) -> list[LoRARequest | None]:
    """Two tiny LoRA adapters of ``model`` taken in turn by ``num_prompts`` prompts, every third
    prompt with none."""
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(make_tiny_lora(str(model), tmp_path / f"a{i}", seed=i)))
        for i in range(2)
    ]
    return [adapters[i % 2] if i % 3 else None for i in range(num_prompts)]
