"""The model and proposer config the speculative-decoding tests share: a small random Llama
whose greedy outputs fall into loops (HF's 0.02 init, vocabulary 256), so n-gram prompt lookup
proposes tokens the target really emits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.tiny_models import make_random_model

VOCAB = 256


def make_looping_model(path: Path, max_position_embeddings: int = 256) -> Path:
    return make_random_model(
        path,
        hidden_size=64,
        num_hidden_layers=2,
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
