"""Rotary embeddings (engine.models.rotary) and rope config parsing (engine.rope_config)
against transformers' own rotary modules, for every rope type, inside and beyond the original
context. Position-dependent types (dynamic, longrope) are compared with HF decoding one token:
position p against HF called with position_ids [[p]] (see rotary._inv_freq_per_position)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen2Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply
from transformers.utils import logging as hf_logging

from engine.errors import ConfigError
from engine.models.rotary import RopeCache, RotaryEmbedding, rope_cos_sin
from engine.rope_config import check_rope, rope_max_positions, rope_parameters
from llm_kernels.backend import get_kernel_ops

ROOT = Path(__file__).resolve().parents[3]
# fp32: our cos/sin are within one float32 ulp of HF's (cos of the same float32 angle).
TOL = {"rtol": 1e-6, "atol": 1e-6}
ORIGINAL = 64  # the trained context of the small test configs
HEAD_DIM = 32

hf_logging.set_verbosity_error()  # HF warns about Phi-3's factor-less longrope, on purpose here


def _llama_shape(**extra: Any) -> dict[str, Any]:
    return {
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 1,
        "intermediate_size": 16,
        "vocab_size": 32,
        **extra,
    }


# Classic config.json rope fields of each type, with the original context ORIGINAL.
CLASSIC: dict[str, dict[str, Any]] = {
    "default": _llama_shape(max_position_embeddings=4 * ORIGINAL, rope_theta=10000.0),
    "linear": _llama_shape(
        max_position_embeddings=ORIGINAL, rope_scaling={"type": "linear", "factor": 4.0}
    ),
    "dynamic": _llama_shape(
        max_position_embeddings=ORIGINAL, rope_scaling={"type": "dynamic", "factor": 4.0}
    ),
    "llama3": _llama_shape(
        max_position_embeddings=8 * ORIGINAL,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
    "yarn": _llama_shape(
        max_position_embeddings=ORIGINAL,
        rope_theta=1e6,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
    "longrope": _llama_shape(
        max_position_embeddings=4 * ORIGINAL,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
            "long_factor": [1.0 + 0.4 * i for i in range(HEAD_DIM // 2)],
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
}
# Positions inside the original context and beyond it, up to the last one served.
POSITIONS = [0, 1, 17, ORIGINAL - 2, ORIGINAL - 1, ORIGINAL, ORIGINAL + 1, 2 * ORIGINAL + 5]


def _quiet(make: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make(*args, **kwargs)


def _hf_decode(module: torch.nn.Module, position: int, **kwargs: Any) -> tuple[Any, Any]:
    """HF's cos/sin for one decode step at ``position`` ([D] each)."""
    cos, sin = module(torch.zeros(1), torch.tensor([[position]]), **kwargs)
    return cos[0, 0], sin[0, 0]


def _our_tables(hf: dict[str, Any], layer_type: str | None = None) -> tuple[Any, Any]:
    return rope_cos_sin(HEAD_DIM, rope_max_positions(hf), rope_parameters(hf, layer_type))


# --- cos/sin against HF, every type ------------------------------------------------------------


@pytest.mark.parametrize("rope_type", sorted(CLASSIC))
def test_cos_sin_equal_hf_decode_inside_and_beyond_the_original_context(rope_type):
    config = _quiet(LlamaConfig, **CLASSIC[rope_type])
    cos, sin = _our_tables(config.to_dict())
    positions = [*POSITIONS, len(cos) - 1]
    assert len(cos) >= 4 * ORIGINAL
    for position in positions:
        # A fresh module per step: HF's dynamic update keeps state between calls.
        hf_cos, hf_sin = _hf_decode(_quiet(LlamaRotaryEmbedding, config), position)
        torch.testing.assert_close(cos[position], hf_cos, **TOL)
        torch.testing.assert_close(sin[position], hf_sin, **TOL)


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3", "yarn"])
def test_static_types_equal_hf_over_every_position_at_once(rope_type):
    config = _quiet(LlamaConfig, **CLASSIC[rope_type])
    cos, sin = _our_tables(config.to_dict())
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(len(cos))[None])
    torch.testing.assert_close(cos, hf_cos[0], **TOL)
    torch.testing.assert_close(sin, hf_sin[0], **TOL)


def test_yarn_mscale_beta_and_truncate_are_read_like_hf():
    fields = {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "truncate": False,
    }
    config = _quiet(
        LlamaConfig, **_llama_shape(max_position_embeddings=ORIGINAL, rope_scaling=fields)
    )
    cos, sin = _our_tables(config.to_dict())
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(len(cos))[None])
    assert rope_parameters(config.to_dict())["attention_factor"] != 1.0
    torch.testing.assert_close(cos, hf_cos[0], **TOL)
    torch.testing.assert_close(sin, hf_sin[0], **TOL)


def test_hf_one_shot_prefill_beyond_the_original_length_differs_for_dynamic():
    """HF's dynamic NTK picks one base from the length of the whole call: a 100-token prompt
    on a 64-token model rotates every position with seq_len 100's base. We fix each position
    to the base HF uses when it decodes it (seq_len p + 1), so only the last row agrees; the
    others, those inside the original context included, differ. This is the price of a
    rotation that does not depend on how a sequence was batched (see the rotary docstring)."""
    config = _quiet(LlamaConfig, **CLASSIC["dynamic"])
    cos, _ = _our_tables(config.to_dict())
    length = 100
    hf_cos, _ = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(length)[None])
    torch.testing.assert_close(cos[length - 1], hf_cos[0, length - 1], **TOL)
    for position in (5, ORIGINAL - 1, 80):
        assert (cos[position] - hf_cos[0, position]).abs().max() > 1e-3


def test_rotated_q_and_k_equal_hf():
    config = _quiet(LlamaConfig, **CLASSIC["llama3"])
    hf = config.to_dict()
    rotary = RotaryEmbedding(HEAD_DIM, rope_max_positions(hf), rope_parameters(hf))
    positions = torch.tensor([0, 3, ORIGINAL - 1, ORIGINAL, 5 * ORIGINAL + 3])
    q, k = torch.randn(len(positions), 2, HEAD_DIM), torch.randn(len(positions), 1, HEAD_DIM)
    got_q, got_k = rotary(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])
    # HF's layout is [batch, heads, tokens, dim]; ours [tokens, heads, dim].
    want_q, want_k = llama_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), **TOL)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), **TOL)


# --- partial rotary, Phi-3 longrope -------------------------------------------------------------

PHI3_HEAD_DIM = 64
PHI3: dict[str, Any] = {
    "model_type": "phi3",
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "intermediate_size": 16,
    "vocab_size": 32,
    "max_position_embeddings": 4 * ORIGINAL,
    "original_max_position_embeddings": ORIGINAL,  # Phi-3 keeps it at the top level
    "partial_rotary_factor": 0.75,  # Phi-4-mini: 48 of 64 dims rotate
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(24)],
        "long_factor": [1.0 + 0.5 * i for i in range(24)],
    },
}


def test_phi3_partial_rotary_longrope_equals_hf_decode_and_passes_the_rest_through():
    config = _quiet(Phi3Config, **PHI3)
    hf = config.to_dict()
    params = rope_parameters(hf)
    rotary = RotaryEmbedding(PHI3_HEAD_DIM, rope_max_positions(hf), params)
    assert rotary.rotary_dim == 48 and rotary.cos.shape == (4 * ORIGINAL, 48)
    assert params["attention_factor"] > 1.0  # from factor = 256 / 64, as HF derives it
    positions = torch.tensor([*POSITIONS, 4 * ORIGINAL - 1])
    q = torch.randn(len(positions), 4, PHI3_HEAD_DIM)
    k = torch.randn(len(positions), 2, PHI3_HEAD_DIM)
    got_q, got_k = rotary(positions, q, k)
    for t, position in enumerate(positions.tolist()):
        hf_cos, hf_sin = _hf_decode(_quiet(Phi3RotaryEmbedding, config), position)
        torch.testing.assert_close(rotary.cos[position], hf_cos, **TOL)
        torch.testing.assert_close(rotary.sin[position], hf_sin, **TOL)
        want_q, want_k = phi3_apply(
            q[t][None, :, None], k[t][None, :, None], hf_cos[None, None], hf_sin[None, None]
        )
        torch.testing.assert_close(got_q[t], want_q[0, :, 0], **TOL)
        torch.testing.assert_close(got_k[t], want_k[0, :, 0], **TOL)
    torch.testing.assert_close(got_q[..., 48:], q[..., 48:], rtol=0, atol=0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_partial_rotary_through_the_triton_kernel_equals_the_torch_one():
    # CUDA tensors on a GPU, CPU tensors through the Triton interpreter without one (conftest).
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = rope_parameters(PHI3)
    positions = torch.tensor([0, 70, 200], device=device)
    q = torch.randn(3, 4, PHI3_HEAD_DIM, device=device)
    k = torch.randn(3, 2, PHI3_HEAD_DIM, device=device)
    with device:
        torch_rotary = RotaryEmbedding(PHI3_HEAD_DIM, 256, params)
        triton_rotary = RotaryEmbedding(PHI3_HEAD_DIM, 256, params, get_kernel_ops("triton"))
    for got, want in zip(triton_rotary(positions, q, k), torch_rotary(positions, q, k)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- Gemma 3: local and global ropes ------------------------------------------------------------

GEMMA3: dict[str, Any] = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": HEAD_DIM,
    "num_hidden_layers": 6,
    "intermediate_size": 16,
    "vocab_size": 32,
    "max_position_embeddings": 8 * ORIGINAL,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window_pattern": 6,
}


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_gemma3_local_and_global_tables_equal_hf(layer_type):
    config = _quiet(Gemma3TextConfig, **GEMMA3)
    for hf in (GEMMA3, config.to_dict()):
        cos, sin = _our_tables(hf, layer_type)
        assert len(cos) == 8 * ORIGINAL  # Gemma 3's max_position_embeddings is never scaled
        hf_cos, hf_sin = Gemma3RotaryEmbedding(config)(
            torch.zeros(1), torch.arange(len(cos))[None], layer_type
        )
        torch.testing.assert_close(cos, hf_cos[0], **TOL)
        torch.testing.assert_close(sin, hf_sin[0], **TOL)


def test_gemma3_local_layers_rotate_unscaled_with_the_local_base():
    assert rope_parameters(GEMMA3, "sliding_attention") == {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 1.0,
    }
    assert rope_parameters(GEMMA3, "full_attention") == {
        "rope_type": "linear",
        "rope_theta": 1_000_000.0,
        "partial_rotary_factor": 1.0,
        "factor": 8.0,
    }


# --- both config formats ------------------------------------------------------------------------

FORMAT_CASES: dict[str, tuple[Any, dict[str, Any], list[str | None]]] = {
    "llama3": (LlamaConfig, CLASSIC["llama3"], [None]),
    "dynamic (legacy type)": (LlamaConfig, CLASSIC["dynamic"], [None]),
    "qwen2.5 yarn (legacy type)": (
        Qwen2Config,
        {
            "model_type": "qwen2",
            "max_position_embeddings": 32768,
            "rope_theta": 1e6,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        },
        ["full_attention"],
    ),
    "phi3 longrope, partial rotary": (Phi3Config, PHI3, [None]),
    "gemma3 local and global": (
        Gemma3TextConfig,
        GEMMA3,
        ["sliding_attention", "full_attention", None],
    ),
}


@pytest.mark.parametrize("case", sorted(FORMAT_CASES))
def test_classic_config_json_and_transformers5_format_give_the_same_parameters(case):
    config_class, classic, layer_types = FORMAT_CASES[case]
    v5 = _quiet(config_class, **classic).to_dict()
    assert "rope_scaling" not in v5 and "rope_parameters" in v5
    for layer_type in layer_types:
        assert rope_parameters(v5, layer_type) == rope_parameters(classic, layer_type)
    assert rope_max_positions(v5) == rope_max_positions(classic)


def test_every_type_has_its_resolved_fields():
    yarn = rope_parameters(CLASSIC["yarn"])
    assert yarn == {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "partial_rotary_factor": 1.0,
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": pytest.approx(0.1 * torch.tensor(4.0).log().item() + 1.0),
        "truncate": True,
    }
    dynamic = rope_parameters(CLASSIC["dynamic"])
    assert dynamic["original_max_position_embeddings"] == ORIGINAL and dynamic["factor"] == 4.0


# --- check_rope ---------------------------------------------------------------------------------


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**base, **changes}


BAD_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "unknown rope_type": (
        {"rope_scaling": {"rope_type": "foo", "factor": 2.0}},
        "rope_scaling.rope_type: 'foo' is not supported "
        "(default, linear, dynamic, llama3, yarn, longrope)",
    ),
    "unknown legacy type": ({"rope_scaling": {"type": "bar"}}, "rope_scaling.type: 'bar'"),
    "unknown type, transformers-5 per layer type": (
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "mrope", "rope_theta": 1e6},
            },
        },
        "rope_parameters.full_attention.rope_type: 'mrope' is not supported",
    ),
    "zero factor": (
        _with(CLASSIC["linear"], rope_scaling={"rope_type": "linear", "factor": 0}),
        "rope_scaling.factor: must be a number > 0, got 0",
    ),
    "missing factor": (
        _with(CLASSIC["linear"], rope_scaling={"rope_type": "dynamic"}),
        "rope_scaling.factor: required for rope_type 'dynamic'",
    ),
    "llama3 high <= low": (
        _with(
            CLASSIC["llama3"],
            rope_scaling={**CLASSIC["llama3"]["rope_scaling"], "high_freq_factor": 1.0},
        ),
        "rope_scaling.high_freq_factor: must be > low_freq_factor (1.0), got 1.0",
    ),
    "llama3 missing low_freq_factor": (
        _with(CLASSIC["llama3"], rope_scaling={"rope_type": "llama3", "factor": 8.0}),
        "rope_scaling.low_freq_factor: required for rope_type 'llama3'",
    ),
    "longrope factors of the wrong length": (
        _with(PHI3, rope_scaling={**PHI3["rope_scaling"], "long_factor": [1.0] * 32}),
        "rope_scaling.long_factor: must have 24 entries (half the rotary dimensions), got 32",
    ),
    "longrope without short_factor": (
        _with(PHI3, rope_scaling={"type": "longrope", "long_factor": [1.0] * 24}),
        "rope_scaling.short_factor: required for rope_type 'longrope'",
    ),
    "negative theta": (_with(CLASSIC["default"], rope_theta=-1.0), "rope_theta: must be"),
    "partial rotary above 1": (
        _with(CLASSIC["default"], partial_rotary_factor=1.5),
        "partial_rotary_factor: must be in (0, 1], got 1.5",
    ),
    "odd rotary dim": (
        _with(CLASSIC["default"], head_dim=10, partial_rotary_factor=0.5),
        "partial_rotary_factor: 0.5 rotates 5 of the 10 head dimensions",
    ),
    "layer type whose rope is null": (
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": None,
            },
        },
        "rope_parameters.sliding_attention: layers without rope are not supported",
    ),
    "layer type without a rope": (
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        },
        "rope_parameters: has no entry for layer type 'sliding_attention'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_check_rope_names_the_field_and_the_value(case):
    hf, message = BAD_CONFIGS[case]
    with pytest.raises(ConfigError) as error:
        check_rope(hf)
    assert message in str(error.value)


@pytest.mark.parametrize("case", sorted(FORMAT_CASES))
def test_check_rope_accepts_real_configs_in_both_formats(case):
    config_class, classic, _ = FORMAT_CASES[case]
    check_rope(classic)
    check_rope(_quiet(config_class, **classic).to_dict())


# --- rope_max_positions -------------------------------------------------------------------------

LLAMA_31 = {
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


@pytest.mark.parametrize(
    ("hf", "expected"),
    [
        pytest.param({"max_position_embeddings": 4096}, 4096, id="default"),
        pytest.param(LLAMA_31, 131072, id="llama3 already extended"),
        pytest.param(
            {
                "max_position_embeddings": 32768,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                },
            },
            131072,
            id="qwen2.5 yarn: original * factor",
        ),
        pytest.param(
            {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}},
            16384,
            id="linear: times factor",
        ),
        pytest.param(
            {"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
            8192,
            id="dynamic: times factor",
        ),
        pytest.param(
            _with(PHI3, max_position_embeddings=131072, original_max_position_embeddings=4096),
            131072,
            id="longrope already extended",
        ),
        pytest.param(GEMMA3, 8 * ORIGINAL, id="gemma3 never scaled"),
    ],
)
def test_rope_max_positions_follows_vllm(hf, expected):
    assert rope_max_positions(hf) == expected


# --- RopeCache and buffers ----------------------------------------------------------------------


def test_rope_cache_returns_one_shared_module_for_equal_specs():
    cache = RopeCache()
    ops = get_kernel_ops("torch")
    params = rope_parameters(PHI3)
    first = cache.get(PHI3_HEAD_DIM, 256, params, ops)
    # An equal spec built separately (new dict, new lists, new ops bundle) is the same module.
    again = cache.get(PHI3_HEAD_DIM, 256, rope_parameters(dict(PHI3)), get_kernel_ops("torch"))
    assert again is first
    assert cache.get(PHI3_HEAD_DIM, 512, params, ops) is not first
    assert cache.get(PHI3_HEAD_DIM, 256, rope_parameters(CLASSIC["default"]), ops) is not first
    assert len(cache) == 3


def test_gemma3_layers_share_two_tables():
    cache = RopeCache()
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    layers = [
        cache.get(HEAD_DIM, rope_max_positions(GEMMA3), rope_parameters(GEMMA3, t))
        for t in layer_types * 2
    ]
    assert len(cache) == 2 and len({id(m) for m in layers}) == 2
    assert cache.buffer_bytes() == 2 * 2 * 8 * ORIGINAL * HEAD_DIM * 4


def test_tables_are_non_persistent_buffers_shared_across_layers():
    cache = RopeCache()
    params = rope_parameters(CLASSIC["default"])
    model = torch.nn.ModuleList(cache.get(HEAD_DIM, 256, params) for _ in range(4))
    assert model.state_dict() == {}
    assert len(list(model.buffers())) == 2  # one cos, one sin for all four layers
    assert model[0].cos.dtype == torch.float32 and model[0].cos.shape == (256, HEAD_DIM)


def test_meta_construction_allocates_shapes_only():
    params = rope_parameters(LLAMA_31)
    with torch.device("meta"):
        rotary = RotaryEmbedding(128, rope_max_positions(LLAMA_31), params)
    assert rotary.cos.is_meta and rotary.cos.shape == (131072, 128)


def test_rotary_embedding_refuses_unnormalized_or_unknown_params_even_on_meta():
    with torch.device("meta"), pytest.raises(ValueError, match="rope_type: 'foo'"):
        RotaryEmbedding(HEAD_DIM, 64, {"rope_type": "foo", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_type: None"):
        RotaryEmbedding(HEAD_DIM, 64, {"rope_scaling": {"rope_type": "linear"}})


def test_rope_config_imports_no_torch():
    code = "import sys, engine.rope_config; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
