"""Built-in pooling models (random weights, the tiny tokenizer), each in the layout of the
checkpoints it stands for:

    tiny-qwen3-classifier      Qwen3ForSequenceClassification, 3 labels with names
    tiny-llama-cross-encoder   LlamaForSequenceClassification, 1 label (a reranker's score)
    tiny-qwen3-embedding       Qwen3-Embedding's layout: config ``Qwen3ForCausalLM``, weights
                               saved from the bare ``Qwen3Model`` (no ``model.`` prefix, no LM
                               head, untied); serve it with ``runner: pooling``

A Qwen3-Reranker is a plain causal LM (``builtin:tiny-qwen3``) served with ``hf_overrides``
naming its classifier tokens (``docs/pooling.md``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModel, AutoModelForSequenceClassification, PreTrainedModel

from engine.builtin.builtin_names import builtin_dirname
from engine.builtin.tiny_models import (
    NORM_WEIGHT_NOISE,
    _build_config,
    _write_config,
    materialize,
    save_weights,
)
from engine.builtin.tiny_tokenizer import build_tokenizer, write_tokenizer

# One recipe per name of TINY_POOLING_MODEL_NAMES (the version: engine.builtin.builtin_names).
_RECIPES: dict[str, tuple[str, dict[str, Any], str]] = {
    "tiny-qwen3-classifier": (
        "tiny-qwen3",
        {"id2label": {0: "negative", 1: "neutral", 2: "positive"}},
        "classify",
    ),
    "tiny-llama-cross-encoder": ("tiny-llama", {"num_labels": 1}, "classify"),
    "tiny-qwen3-embedding": ("tiny-qwen3", {"tie_word_embeddings": False}, "embed"),
}


def make_tiny_pooling_model(name: str, out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write the pooling model ``name`` into ``out_dir`` (created if missing)."""
    base, overrides, task = _RECIPES[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = _build_config(base, tokenizer.get_vocab_size(), overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        auto = AutoModelForSequenceClassification if task == "classify" else AutoModel
        model: PreTrainedModel = auto.from_config(config, dtype=torch.float32).eval()
    _perturb_norms(model, seed)
    save_weights(model.state_dict(), out / "model.safetensors")
    # Qwen3-Embedding's config names the causal LM; its weights are the bare model's.
    architecture = type(model).__name__ if task == "classify" else "Qwen3ForCausalLM"
    _write_config(config, architecture, out / "config.json")
    if task == "classify":  # the labels are what a classifier's config.json carries
        _add_labels(out / "config.json", config.id2label)
    write_tokenizer(tokenizer, out)
    return out


def _perturb_norms(model: PreTrainedModel, seed: int) -> None:
    # As the generative built-ins: a norm left at exactly 1 would hide a loader that drops it.
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
                param.add_(NORM_WEIGHT_NOISE * noise)


def _add_labels(path: Path, id2label: dict[int, str]) -> None:
    data = json.loads(path.read_text())
    data["id2label"] = {str(k): v for k, v in id2label.items()}
    data["label2id"] = {v: k for k, v in id2label.items()}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def materialize_tiny_pooling(name: str) -> Path:
    return materialize(builtin_dirname(name), lambda out: make_tiny_pooling_model(name, out))


__all__ = ["make_tiny_pooling_model", "materialize_tiny_pooling"]
