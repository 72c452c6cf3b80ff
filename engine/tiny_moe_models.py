"""Built-in tiny mixture-of-experts models, and a random Qwen3-MoE bench model, written locally
in Hugging Face format like the dense ones of :mod:`engine.tiny_models` (same tokenizer, same
init recipe, same cache), so tests compare the engine with HF transformers offline.

    name            family     experts  top-k  layers           quirk
    tiny-mixtral    Mixtral    8        2      2 sparse         top-k renormalized, fp32 weights
    tiny-qwen2-moe  Qwen2-MoE  8        4      2 sparse         shared expert + sigmoid gate
    tiny-qwen3-moe  Qwen3-MoE  8        2      sparse, dense,   norm_topk_prob, mlp_only_layers
                                                   sparse

The weights are written with ``save_pretrained``, so the checkpoint has the per-expert tensors
(``experts.N.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.N.w1.weight``) that
transformers writes and real checkpoints hold, not its in-memory stacked layout.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from engine.tiny_models import (
    _COMMON_CONFIG,
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IM_END_TOKEN_ID,
    PAD_TOKEN_ID,
    VERSION,
    _build_model,
    _write_config,
    materialize,
)
from engine.tiny_tokenizer import build_tokenizer, write_json, write_tokenizer

# Bump whenever an MoE recipe changes (on top of engine.tiny_models.VERSION, which covers the
# tokenizer and init shared with the dense models).
MOE_VERSION = 1
TINY_MOE_MODEL_NAMES: tuple[str, ...] = ("tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe")

_MOE_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "tiny-mixtral": (
        MixtralConfig,
        {
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": None,
            "tie_word_embeddings": False,
        },
    ),
    "tiny-qwen2-moe": (
        Qwen2MoeConfig,
        {
            "num_key_value_heads": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96,
            "num_experts": 8,
            "num_experts_per_tok": 4,
            "norm_topk_prob": False,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
        },
    ),
    # Layer 1 is dense (mlp_only_layers); the other two are sparse.
    "tiny-qwen3-moe": (
        Qwen3MoeConfig,
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "use_sliding_window": False,
            "attention_bias": False,
            "tie_word_embeddings": False,
        },
    ),
}
_GENERATION_CONFIG = {
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": [EOS_TOKEN_ID, IM_END_TOKEN_ID],
    "pad_token_id": PAD_TOKEN_ID,
}


def _check_moe_name(name: str) -> None:
    if name not in TINY_MOE_MODEL_NAMES:
        raise ValueError(
            f"unknown tiny MoE model name {name!r}; valid names are "
            f"{', '.join(TINY_MOE_MODEL_NAMES)}"
        )


def make_tiny_moe_model(
    name: str,
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write the tiny MoE model ``name`` with weights drawn from ``seed`` into ``out_dir``
    (the recipe of :func:`engine.tiny_models.make_tiny_model`)."""
    _check_moe_name(name)
    config_class, specific = _MOE_CONFIGS[name]
    tokenizer = build_tokenizer()
    kwargs = {**_COMMON_CONFIG, **specific, **(config_overrides or {})}
    config = config_class(vocab_size=tokenizer.get_vocab_size(), **kwargs)
    out = Path(out_dir)
    _save(_build_model(config, seed), config, out)
    write_tokenizer(tokenizer, out)
    return out


def _save(model: Any, config: PretrainedConfig, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # save_pretrained writes the per-expert tensors real checkpoints hold; config.json and
    # generation_config.json are then rewritten like the dense tiny models'.
    model.save_pretrained(str(out))
    for path in out.iterdir():
        path.chmod(0o644)
    _write_config(config, type(model).__name__, out / "config.json")
    write_json(out / "generation_config.json", _GENERATION_CONFIG)


def materialize_tiny_moe(name: str) -> Path:
    """``builtin:<name>`` of a tiny MoE model: written once into the model cache."""
    _check_moe_name(name)
    return materialize(
        f"{name}-v{VERSION}.{MOE_VERSION}", lambda out: make_tiny_moe_model(name, out)
    )


def tiny_moe_variant(name: str, **config_overrides: Any) -> Path:
    """The tiny MoE model ``name`` with HF config fields changed, cached like a built-in."""
    _check_moe_name(name)
    key = json.dumps(config_overrides, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return materialize(
        f"{name}-{digest}-v{VERSION}.{MOE_VERSION}",
        lambda out: make_tiny_moe_model(name, out, config_overrides=config_overrides),
    )


def make_random_qwen3_moe(
    out_dir: str | os.PathLike[str],
    *,
    hidden_size: int = 1024,
    num_hidden_layers: int = 12,
    num_attention_heads: int = 16,
    num_key_value_heads: int = 4,
    moe_intermediate_size: int = 768,
    num_experts: int = 16,
    num_experts_per_tok: int = 4,
    vocab_size: int = 32000,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> Path:
    """A random-weight ``Qwen3MoeForCausalLM`` for benchmarks: at the defaults ~0.55 B
    parameters in all (16 experts of 3 x 1024 x 768 per layer, 12 layers, a 32000-token
    vocabulary), ~0.2 B active per token (top-4). Built only on request (minutes, ~2.5 GiB of
    float32 while it is written)."""
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * moe_intermediate_size,
        moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        norm_topk_prob=True,
        max_position_embeddings=max_position_embeddings,
        rope_theta=_COMMON_CONFIG["rope_theta"],
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        use_sliding_window=False,
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out = Path(out_dir)
    _save(model, config, out)
    write_tokenizer(build_tokenizer(vocab_size), out)
    return out
