"""Built-in tiny mixture-of-experts models, and a random Qwen3-MoE bench model, written locally
in Hugging Face format like the dense ones of :mod:`engine.builtin.tiny_models` (same tokenizer,
same init recipe, same cache), so tests compare the engine with HF transformers offline. The models
(Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4.5, gpt-oss) and the quirk each one exercises
are tabled below (their names, with the recipe's version, in ``engine.builtin.builtin_names``).

The weights are written with ``save_pretrained``, so the checkpoint has the per-expert tensors
(``experts.N.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.N.w1.weight``) that
transformers writes and real checkpoints hold, not its in-memory stacked layout.
``write_mxfp4_gpt_oss`` rewrites a gpt-oss checkpoint with its experts in MXFP4, as gpt-oss
ships them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from engine.builtin.builtin_names import MOE_VERSION, TINY_MOE_MODEL_NAMES, VERSION, builtin_dirname
from engine.builtin.tiny_harmony import (
    HARMONY_STOP_TOKEN_IDS,
    build_harmony_tokenizer,
    write_harmony_tokenizer,
)
from engine.builtin.tiny_models import (
    _COMMON_CONFIG,
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    _build_model,
    _write_config,
    materialize,
)
from engine.builtin.tiny_tokenizer import (
    GENERATION_CONFIG,
    build_tokenizer,
    write_json,
    write_tokenizer,
)
from engine.hf_config import DEEPSEEK_ARCHITECTURES, config_field
from llm_kernels.mxfp4 import quantize_mxfp4

# The built-in models and what each one tests:
#
#  name              family       experts  top-k  layers          quirk
#  tiny-mixtral      Mixtral      8        2      2 sparse        top-k renormalized, fp32 weights
#  tiny-qwen2-moe    Qwen2-MoE    8        4      2 sparse        shared expert + sigmoid gate
#  tiny-qwen3-moe    Qwen3-MoE    8        2      sparse, dense,  norm_topk_prob, mlp_only_layers
#                                                 sparse
#  tiny-deepseek-v3  DeepSeek-V3  8 in 4   2      dense, 2 sparse MLA with q_lora, sigmoid
#                                 groups                          noaux_tc over 2 groups, a
#                                                                 non-zero correction bias, yarn
#                                                                 with mscale / mscale_all_dim
#  tiny-deepseek-v2  DeepSeek-V2  8        2      dense, 2 sparse MLA without q_lora (V2-Lite's
#                                                                 shape), softmax greedy, 2
#                                                                 shared experts
#  tiny-glm4-moe     GLM-4.5      8 in 2   2      dense, 2 sparse half of each head rotated,
#                                 groups                          q/k norm, q/k/v biases,
#                                                                 V3's router with a non-zero
#                                                                 correction bias, 1 shared
#  tiny-gpt-oss      gpt-oss      8        2      4 sparse,       sinks, window 8, yarn from
#                                                 sliding / full  64 positions, biased router
#                                                 alternating     and experts, SwiGLU clamped
#                                                                 often; harmony tokenizer

# Multi-head latent attention at a small scale: 4 heads, q_lora 48 (V3), latent 32 + rope 8.
_MLA_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 3,
    "intermediate_size": 96,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "tie_word_embeddings": False,
}
# The correction bias HF leaves at zero, drawn instead: a zero bias would not test it.
CORRECTION_BIAS_NOISE = 0.1
# gpt-oss's sinks (HF draws them at std 0.02, where they change nothing) and expert biases
# (HF: zero) are drawn at these scales.
SINK_NOISE = 1.0
EXPERT_BIAS_NOISE = 0.1
GPT_OSS_SWIGLU_LIMIT = 2.0

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
    # Past position 256 the yarn rope (factor 4) takes over, and mscale_all_dim scales the
    # softmax: the correctness prompts run to 300 tokens + 64.
    "tiny-deepseek-v3": (
        DeepseekV3Config,
        {
            **_MLA_SHAPE,
            "q_lora_rank": 48,
            # factor x original, as in DeepSeek-V3's config (163840 = 40 x 4096).
            "max_position_embeddings": 1024,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
        },
    ),
    "tiny-deepseek-v2": (
        DeepseekV2Config,
        {
            **_MLA_SHAPE,
            "q_lora_rank": None,
            "n_shared_experts": 2,
            "topk_method": "greedy",
            "routed_scaling_factor": 1.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # GLM-4.5's quirks at a small scale: 4 heads of 32 over a hidden size of 64 (heads x
    # head_dim != hidden, as in GLM-4.5), 16 of each head's dims rotated, layer 0 dense.
    "tiny-glm4-moe": (
        Glm4MoeConfig,
        {
            "num_hidden_layers": 3,
            "intermediate_size": 96,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": True,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "num_nextn_predict_layers": 1,
            "tie_word_embeddings": False,
        },
    ),
    # gpt-oss's quirks at a small scale: 4 layers alternating a window of 8 with full attention
    # (prompts are longer), yarn x32 over 64 trained positions as gpt-oss's over 4096 (decoding
    # runs past them), and a SwiGLU limit that clamps ~1 in 5 values on random weights.
    "tiny-gpt-oss": (
        GptOssConfig,
        {
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 32,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "swiglu_limit": GPT_OSS_SWIGLU_LIMIT,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            "tie_word_embeddings": False,
        },
    ),
}
# The _COMMON_CONFIG fields DeepSeek's configs derive themselves (head_dim = qk_rope_head_dim)
# or take inside rope_parameters.
_NOT_FOR_DEEPSEEK = ("head_dim", "rope_theta")


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
    (the recipe of :func:`engine.builtin.tiny_models.make_tiny_model`)."""
    _check_moe_name(name)
    config_class, specific = _MOE_CONFIGS[name]
    harmony = name == "tiny-gpt-oss"
    tokenizer = build_harmony_tokenizer() if harmony else build_tokenizer()
    common = _COMMON_CONFIG
    if name.startswith("tiny-deepseek") or harmony:
        common = {k: v for k, v in common.items() if k not in _NOT_FOR_DEEPSEEK}
    kwargs = {**common, **specific, **(config_overrides or {})}
    config = config_class(vocab_size=tokenizer.get_vocab_size(), **kwargs)
    out = Path(out_dir)
    model = _build_model(config, seed)
    _draw_correction_bias(model, seed)
    _draw_gpt_oss_extras(model, seed)
    _save(model, config, out)
    if harmony:
        write_harmony_tokenizer(tokenizer, out)
        eos = [EOS_TOKEN_ID, *HARMONY_STOP_TOKEN_IDS]
        write_json(out / "generation_config.json", {**GENERATION_CONFIG, "eos_token_id": eos})
    else:
        write_tokenizer(tokenizer, out)
    return out


def _draw_correction_bias(model: Any, seed: int) -> None:
    """DeepSeek-V3's and GLM-4.5's ``e_score_correction_bias`` buffers, drawn (HF starts them
    at zero)."""
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                noise = torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype)
                buffer.copy_(CORRECTION_BIAS_NOISE * noise)


def _draw_gpt_oss_extras(model: Any, seed: int) -> None:
    """gpt-oss's attention sinks and expert biases, drawn large enough to matter."""
    generator = torch.Generator().manual_seed(seed + 3)
    scales = {"self_attn.sinks": SINK_NOISE, "_proj_bias": EXPERT_BIAS_NOISE}
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            scale = next((v for k, v in scales.items() if name.endswith(k)), None)
            if scale is not None:
                noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
                param.copy_(scale * noise)


def _save(model: Any, config: PretrainedConfig, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if type(model).__name__ in DEEPSEEK_ARCHITECTURES:
        # The published DeepSeek config.json files name their routing, which other readers
        # (vLLM) rely on; transformers' configs leave the fields out.
        fields = {**config.to_dict(), "architectures": [type(model).__name__]}
        for key in ("topk_method", "scoring_func"):
            setattr(config, key, config_field(fields, key))
    # save_pretrained writes the per-expert tensors real checkpoints hold; config.json and
    # generation_config.json are then rewritten like the dense tiny models'.
    model.save_pretrained(str(out))
    for path in out.iterdir():
        path.chmod(0o644)
    _write_config(config, type(model).__name__, out / "config.json")
    write_json(out / "generation_config.json", GENERATION_CONFIG)


def materialize_tiny_moe(name: str) -> Path:
    """``builtin:<name>`` of a tiny MoE model: written once into the model cache."""
    _check_moe_name(name)
    return materialize(builtin_dirname(name), lambda out: make_tiny_moe_model(name, out))


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


def make_random_deepseek_v3(
    out_dir: str | os.PathLike[str],
    *,
    hidden_size: int = 768,
    num_hidden_layers: int = 12,
    num_attention_heads: int = 6,
    intermediate_size: int = 1536,
    moe_intermediate_size: int = 512,
    n_routed_experts: int = 16,
    num_experts_per_tok: int = 4,
    vocab_size: int = 32000,
    max_position_embeddings: int = 163840,
    seed: int = 0,
) -> Path:
    """A random-weight ``DeepseekV3ForCausalLM`` for benchmarks, DeepSeek-V3's proportions at
    a width a CPU runs: with ``d = hidden_size // num_attention_heads``, MLA with
    ``qk_nope_head_dim = v_head_dim = d``, ``qk_rope_head_dim = d / 2``, ``kv_lora_rank = 4d``
    and ``q_lora_rank = 6d`` (V3: 128, 64, 512, 1536); layer 0 dense (``intermediate_size``),
    the others ``n_routed_experts`` in 4 groups, top-2 groups, one shared expert, sigmoid
    scores with a drawn correction bias; yarn rope (factor 40 over 4096, V3's). At the defaults
    (6 heads of 128, V3's head) ~0.3 B parameters, and the latent is V3's 512 + 64 = 576 values
    per token and layer, against 1536 for multi-head attention of the same width."""
    head_dim = hidden_size // num_attention_heads
    config = DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        q_lora_rank=6 * head_dim,
        kv_lora_rank=4 * head_dim,
        qk_nope_head_dim=head_dim,
        qk_rope_head_dim=head_dim // 2,
        v_head_dim=head_dim,
        n_routed_experts=n_routed_experts,
        num_experts_per_tok=num_experts_per_tok,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _draw_correction_bias(model, seed)
    out = Path(out_dir)
    _save(model, config, out)
    write_tokenizer(build_tokenizer(vocab_size), out)
    return out


def make_random_gpt_oss(
    out_dir: str | os.PathLike[str],
    *,
    hidden_size: int = 768,
    num_hidden_layers: int = 12,
    num_attention_heads: int = 12,
    num_key_value_heads: int = 4,
    intermediate_size: int = 512,
    num_local_experts: int = 16,
    num_experts_per_tok: int = 4,
    vocab_size: int = 32000,
    seed: int = 0,
) -> Path:
    """A random-weight ``GptOssForCausalLM`` for benchmarks in gpt-oss's proportions: heads of
    ``hidden_size // num_attention_heads`` with sinks and biases, a window of 128 on every
    other layer, yarn (x32 over 4096), every layer ``num_local_experts`` biased experts with
    the clamped SwiGLU (limit 7), top-``num_experts_per_tok``."""
    config = GptOssConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        num_local_experts=num_local_experts,
        num_experts_per_tok=num_experts_per_tok,
        sliding_window=128,
        max_position_embeddings=131072,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _draw_gpt_oss_extras(model, seed)
    out = Path(out_dir)
    _save(model, config, out)
    write_tokenizer(build_tokenizer(vocab_size), out)
    return out


# gpt-oss's released quantization_config: everything but the experts stays bfloat16.
GPT_OSS_MXFP4_CONFIG: dict[str, Any] = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
_EXPERT_PROJECTIONS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def mxfp4_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A gpt-oss checkpoint's tensors with each stacked expert projection ``X`` ``[E, in, out]``
    replaced as gpt-oss ships it: ``X_blocks`` / ``X_scales`` of ``X`` transposed to
    ``[E, out, in]`` (``llm_kernels.mxfp4.quantize_mxfp4``)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not name.endswith(_EXPERT_PROJECTIONS):
            out[name] = tensor
            continue
        blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))
        out[f"{name}_blocks"], out[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
    return out


def write_mxfp4_gpt_oss(src: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """The gpt-oss checkpoint in ``src`` written into ``out`` with MXFP4 experts
    (``mxfp4_tensors``) and ``quantization_config`` in config.json; the other files copied."""
    src, dest = Path(src), Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, dest / path.name)
    for path in sorted(src.glob("*.safetensors")):
        save_file(mxfp4_tensors(load_file(str(path))), str(dest / path.name))
    config = json.loads((src / "config.json").read_text())
    write_json(dest / "config.json", {**config, "quantization_config": GPT_OSS_MXFP4_CONFIG})
    return dest


def materialize_tiny_gpt_oss_mxfp4() -> Path:
    """tiny-gpt-oss with its experts in MXFP4, written once into the model cache."""
    return materialize(
        f"tiny-gpt-oss-mxfp4-v{VERSION}.{MOE_VERSION}",
        lambda out: write_mxfp4_gpt_oss(materialize_tiny_moe("tiny-gpt-oss"), out),
    )
