"""Built-in tiny models: seeded random-weight checkpoints written locally in Hugging Face format.

One role: writing local random-weight checkpoints — the tiny recipes, the random bench models
and their files. The tokenizer they all share (its training, chat template and files) is
``engine.builtin.tiny_tokenizer``, re-exported here.

They exist so that demos and tests (greedy token equality against HF transformers, TP=2 vs TP=1,
detokenization) run offline on a CPU in seconds. Nothing here ever touches a model hub: the
weights come from ``torch.manual_seed`` and the byte-level BPE tokenizer is trained at build time
on ``engine/data/corpus.txt``, which the project ships.

Every model shares one tokenizer, so token ids mean the same thing across all of them:

    id  token            role
    0   <pad>            padding
    1   <s>              bos, prepended to every encoded prompt
    2   </s>             eos, the token generation stops on
    3   <|im_start|>     ChatML turn start
    4   <|im_end|>       ChatML turn end, a second stop token in generation_config.json

A directory written by :func:`make_tiny_model` holds ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and
``generation_config.json``, and loads with ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` like any hub checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from engine import envs
from engine.builtin.builtin_names import TINY_MODEL_NAMES, VERSION
from engine.builtin.tiny_tokenizer import (  # the tokenizer every tiny model shares
    BOS_TOKEN,  # noqa: F401 (re-exported)
    BOS_TOKEN_ID,
    CHAT_TEMPLATE,  # noqa: F401 (re-exported)
    DEFAULT_TOOL_CALL_PARSER,  # noqa: F401 (re-exported)
    EOS_TOKEN,  # noqa: F401 (re-exported)
    EOS_TOKEN_ID,
    GENERATION_CONFIG,
    IM_END_TOKEN,  # noqa: F401 (re-exported)
    IM_END_TOKEN_ID,  # noqa: F401 (re-exported)
    IM_START_TOKEN,  # noqa: F401 (re-exported)
    IM_START_TOKEN_ID,  # noqa: F401 (re-exported)
    MAX_POSITION_EMBEDDINGS,
    PAD_TOKEN,  # noqa: F401 (re-exported)
    PAD_TOKEN_ID,
    PRETOKENIZE_REGEX,  # noqa: F401 (re-exported)
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,  # noqa: F401 (re-exported)
    build_tokenizer,
    write_json,
    write_tokenizer,
)

# HF's default initializer_range of 0.02 makes a 2-layer, 64-wide model nearly uniform over the
# vocabulary: the top-2 logit gap of a greedy step can be ~1e-5, so fp32 rounding differences
# between two correct implementations flip the argmax and token-equality tests fail for no
# reason. A wider init makes attention and MLPs far from linear and spreads the logits.
INITIALIZER_RANGE = 0.2
# Multiplies lm_head (the embedding, when tied) after init, doubling every logit gap. Measured
# with both factors, over 40 prompts x 64 greedy steps per model: the top-1 minus top-2 logit
# gap has a 1st percentile of 0.009-0.014 and a median of 0.68 (tiny-llama with HF's defaults:
# 0.0005 and 0.04), the largest |logit| is ~18, and a 64-token continuation holds ~55 distinct
# tokens.
LM_HEAD_SCALE = 2.0
# Special tokens' output rows are shrunk so their logits sit near 0, far below the top of ~1000
# random logits: greedy generation then practically never emits </s> (which would end a 64-token
# test after a handful of tokens) nor a ChatML marker. When tied this shrinks their input
# embeddings too, which the first RMSNorm undoes.
SPECIAL_TOKEN_ROW_SCALE = 0.05
# RMSNorm weights start at exactly 1 and biases at exactly 0, so a loader that dropped them would
# still match HF. Perturbing them makes a missed or misplaced tensor change the output.
NORM_WEIGHT_NOISE = 0.1
BIAS_NOISE = 0.1
# Gemma scales its (tied) embeddings by sqrt(hidden_size) = 8 while the norms after attention
# and after the MLP bring each branch back to unit scale, so a random tied Gemma's stream is
# its input token's embedding and greedy decoding repeats that token forever. Gemma's norm is
# x * (1 + w): adding 15 to those two norms' w lets the branches speak as loudly as the stream.
GEMMA_BRANCH_NORM_OFFSET = 15.0
_GEMMA_BRANCH_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")

_COMMON_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": INITIALIZER_RANGE,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
    "use_cache": True,
}

_MODEL_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "tiny-llama": (
        LlamaConfig,
        {
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
        },
    ),
    "tiny-mistral": (
        MistralConfig,
        {"num_key_value_heads": 1, "tie_word_embeddings": False, "sliding_window": None},
    ),
    # Qwen2 always has q/k/v biases (and none on o_proj); there is no config switch for them.
    "tiny-qwen2": (
        Qwen2Config,
        {
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "sliding_window": None,
        },
    ),
    # The newer families, each at shapes that exercise its quirks: GQA, a head_dim that is not
    # hidden_size / num_heads, windows shorter than the test prompts, soft-caps small enough to
    # bend the scores (random scores reach ~10), partial rotary and longrope.
    "tiny-qwen3": (
        Qwen3Config,
        {
            "num_key_value_heads": 2,
            "head_dim": 32,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_bias": False,
        },
    ),
    "tiny-gemma2": (
        Gemma2Config,
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 24,
            "sliding_window": 24,
            "attn_logit_softcapping": 4.0,
            "final_logit_softcapping": 12.0,
            "tie_word_embeddings": True,
        },
    ),
    "tiny-gemma3": (
        Gemma3TextConfig,
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 32,
            "sliding_window": 40,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            "tie_word_embeddings": True,
        },
    ),
    # The test prompts (up to 300 tokens + 64) stay inside the 512-position original context,
    # where HF's generate() and the engine agree; tests/engine/models/test_longrope_decoding.py
    # crosses it (long factors from position 512 on, as Phi-3-128k past 4096).
    "tiny-phi3": (
        Phi3Config,
        {
            "num_key_value_heads": 2,
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 512,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.3, 1.6],
                "long_factor": [1.0, 2.0, 4.0, 8.0],
                "original_max_position_embeddings": 512,
                "partial_rotary_factor": 0.5,
            },
            "sliding_window": 64,
            "tie_word_embeddings": False,
        },
    ),
}
# Gemma reads hidden_activation; the common hidden_act would only be noise in its config.json.
_DROPPED_KEYS: dict[str, tuple[str, ...]] = {
    "tiny-gemma2": ("hidden_act", "rope_theta"),
    "tiny-gemma3": ("hidden_act", "rope_theta"),
    "tiny-phi3": ("rope_theta",),
}


def make_tiny_model(
    name: str,
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write the tiny model ``name`` with weights drawn from ``seed`` into ``out_dir``.

    ``config_overrides`` changes HF config fields of the recipe (a Llama with ``mlp_bias``, a
    Mistral with a sliding window, ...); the weights are then those HF initializes for that
    config. The same arguments always give byte-identical files. ``out_dir`` is created if
    missing; files already in it are overwritten.
    """
    _check_name(name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = _build_config(name, tokenizer.get_vocab_size(), config_overrides or {})
    write_tiny_checkpoint(out, config, tokenizer, seed)
    return out


def write_tiny_checkpoint(
    out: Path, config: PretrainedConfig, tokenizer: Tokenizer, seed: int
) -> None:
    """Weights drawn from ``seed``, config, tokenizer and a generation config stopping at EOS
    or ``<|im_end|>`` into the existing directory ``out``."""
    model = _build_model(config, seed)
    _write_weights(model, config, out / "model.safetensors")
    _write_config(config, type(model).__name__, out / "config.json")
    write_tokenizer(tokenizer, out)
    write_json(out / "generation_config.json", GENERATION_CONFIG)


def tiny_variant(name: str, **config_overrides: Any) -> Path:
    """The tiny model ``name`` with HF config fields changed (``tiny_variant("tiny-llama",
    mlp_bias=True)``), written once into the cache like a built-in; weights as HF initializes
    them for that config, then the same recipe."""
    _check_name(name)
    key = json.dumps(config_overrides, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return materialize(
        f"{name}-{digest}-v{VERSION}",
        lambda out: make_tiny_model(name, out, seed=0, config_overrides=config_overrides),
    )


def _check_name(name: str) -> None:
    if name not in TINY_MODEL_NAMES:
        raise ValueError(
            f"unknown tiny model name {name!r}; valid names are {', '.join(TINY_MODEL_NAMES)}"
        )


def materialize(dirname: str, build: Callable[[Path], object]) -> Path:
    """Build a checkpoint once into ``<cache_dir>/models/<dirname>`` and return that path."""
    final = envs.cache_dir() / "models" / dirname
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the final path and rename into place: a rename within one file system is
    # atomic, so a concurrent reader (another Ray worker) sees either no directory or a whole one.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        # mkdtemp makes the directory private (0700); a shared cache should be readable.
        tmp.chmod(0o755)
        os.rename(tmp, final)
    except OSError as exc:
        # Losing the race leaves the winner's complete directory at ``final``: use it.
        lost_race = exc.errno in (errno.EEXIST, errno.ENOTEMPTY)
        if not (lost_race and (final / "config.json").is_file()):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# The families ``make_random_model`` writes (the ``cluster bench throughput --family`` choices).
RANDOM_MODEL_FAMILIES: tuple[str, ...] = ("llama", "qwen3", "gemma2", "gemma3")
# Gemma 3's own: local layers with a window of 1024 on five layers of every six, and (Gemma 3
# 1B's) 32768 positions, so a bench at 8192 tokens has the window at 1/8 of its context.
GEMMA3_WINDOW = 1024
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_MAX_POSITIONS = 32768


def make_random_llama(out_dir: str | os.PathLike[str], **shape: int) -> Path:
    """A random-weight ``LlamaForCausalLM``: :func:`make_random_model` of the llama family."""
    return make_random_model(out_dir, "llama", **shape)


def make_random_model(
    out_dir: str | os.PathLike[str],
    family: str = "llama",
    *,
    hidden_size: int = 768,
    num_hidden_layers: int = 12,
    num_attention_heads: int = 12,
    num_key_value_heads: int = 4,
    intermediate_size: int = 1536,
    vocab_size: int = 32000,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> Path:
    """A random-weight causal LM of ``family`` (one of :data:`RANDOM_MODEL_FAMILIES`) at any
    size (benchmarks), with the built-in tokenizer grown to cover its vocabulary
    (:func:`build_tokenizer`), so every sampled id decodes to text.

    Every family has ``head_dim = hidden_size // num_attention_heads`` and the same matmuls per
    token (q, k, v, o and a gated MLP), so one shape costs the same FLOPs in each; what differs
    is the family's quirks: Qwen3's q/k norms, Gemma2's tied and scaled embeddings, extra norms,
    tanh-GELU, logit soft-caps (50 on attention scores, 30 on the final logits) and a
    4096-token sliding window on every other layer; Gemma3's q/k norms and five layers of six
    with Gemma 3's window of 1024 (the sixth global, on a second rope base) and 32768
    positions.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _random_model_config(
        family,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
    )
    model = _build_model(config, seed)
    _write_weights(model, config, out / "model.safetensors")
    _write_config(config, type(model).__name__, out / "config.json")
    write_tokenizer(build_tokenizer(vocab_size), out)
    write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID},
    )
    return out


def _random_model_config(family: str, **shape: Any) -> PretrainedConfig:
    rope_theta = _COMMON_CONFIG["rope_theta"]
    if family == "llama":
        # Exactly the config the llama bench checkpoints were always written with.
        return LlamaConfig(**shape, rope_theta=rope_theta, tie_word_embeddings=False)
    # Qwen3's and Gemma2's default token ids are their own vocabularies'; ours are the tokenizer's.
    ids = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID}
    if family == "qwen3":
        return Qwen3Config(
            **shape,
            **ids,
            rope_theta=rope_theta,
            use_sliding_window=False,
            sliding_window=None,
            attention_bias=False,
            tie_word_embeddings=False,
        )
    if family == "gemma2":
        return Gemma2Config(
            **shape,
            **ids,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=shape["head_dim"],
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            sliding_window=4096,
            tie_word_embeddings=True,
        )
    if family == "gemma3":
        num_layers = shape["num_hidden_layers"]
        return Gemma3TextConfig(
            **{**shape, "max_position_embeddings": GEMMA3_MAX_POSITIONS},
            **ids,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": rope_theta},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=shape["head_dim"],
            sliding_window=GEMMA3_WINDOW,
            layer_types=[
                "sliding_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN else "full_attention"
                for i in range(num_layers)
            ],
            tie_word_embeddings=True,
        )
    raise ValueError(
        f"family {family!r} has no random bench model; choose one of "
        f"{', '.join(RANDOM_MODEL_FAMILIES)}"
    )


def _build_config(
    name: str, vocab_size: int, overrides: dict[str, Any] | None = None
) -> PretrainedConfig:
    config_class, specific = _MODEL_CONFIGS[name]
    # Qwen2Config has no head_dim field of its own; it keeps the kwarg, so config.json states it
    # for all of them and no reader has to derive it.
    kwargs = {**_COMMON_CONFIG, **specific, **(overrides or {})}
    for key in _DROPPED_KEYS.get(name, ()):
        kwargs.pop(key, None)
    return config_class(vocab_size=vocab_size, **kwargs)


def _build_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    # fork_rng leaves the caller's global RNG as it was; HF's init draws from the global one.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    gemma = config.model_type.startswith("gemma")
    with torch.no_grad():
        for param_name, param in sorted(model.named_parameters()):
            if param_name.endswith("norm.weight"):
                param.add_(NORM_WEIGHT_NOISE * _randn_like(param, generator))
                if gemma and param_name.endswith(_GEMMA_BRANCH_NORMS):
                    param.add_(GEMMA_BRANCH_NORM_OFFSET)
            elif param_name.endswith(".bias"):
                param.copy_(BIAS_NOISE * _randn_like(param, generator))
        output_rows = model.get_output_embeddings().weight
        output_rows.mul_(LM_HEAD_SCALE)
        output_rows[: len(SPECIAL_TOKENS)].mul_(SPECIAL_TOKEN_ROW_SCALE)
    return model.eval()


def _randn_like(param: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(param.shape, generator=generator, dtype=param.dtype)


def _write_weights(model: PreTrainedModel, config: PretrainedConfig, path: Path) -> None:
    state = model.state_dict()
    if config.tie_word_embeddings:
        # Tied checkpoints store the matrix once, under the embedding's name, as HF does.
        state.pop("lm_head.weight", None)
    save_weights(state, path)


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """``state`` as one safetensors file, tensors in name order."""
    tensors = {key: state[key].detach().contiguous().clone() for key in sorted(state)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    # safetensors creates the file private (0600); a shared cache must be readable by others.
    path.chmod(0o644)


# Keys every PretrainedConfig carries for heads and outputs that a causal LM checkpoint never uses.
_GENERIC_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "chunk_size_feed_forward",
        "id2label",
        "label2id",
        "is_encoder_decoder",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
    }
)


def _write_config(config: PretrainedConfig, architecture: str, path: Path) -> None:
    data = {k: v for k, v in config.to_dict().items() if k not in _GENERIC_CONFIG_KEYS}
    data["architectures"] = [architecture]
    # Older readers (transformers 4.x, vLLM-style loaders) look for these top-level keys.
    data["torch_dtype"] = "float32"
    data["dtype"] = "float32"
    rope = data.get("rope_parameters") or {}
    if "rope_theta" in rope:
        data["rope_theta"] = rope["rope_theta"]
    write_json(path, data)
