"""Greedy output equals HF transformers token for token (fp32, same random weights), for each
architecture, under every scheduler regime: defaults, chunked prefill, preemption by recompute
and by swap, and prefix caching.

Each family at shapes that exercise its quirks (engine.builtin.tiny_models): Qwen3's q/k norm and
head_dim != hidden / heads, Gemma 2's soft-caps and alternating windows, Gemma 3's q/k norm,
5:1-style pattern and two rope bases, Phi-3's fused checkpoint tensors, partial rotary,
longrope and window; plus variants with Llama's biases and Mistral / Qwen2 windows shorter
than most prompts (up to 300 tokens + 64 generated)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.builtin.builtin_names import TINY_MOE_MODEL_NAMES
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_models import make_tiny_model, tiny_variant
from engine.builtin.tiny_moe_models import make_tiny_moe_model
from engine.errors import ConfigError

# name -> (built-in, HF config overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("tiny-llama", {}),
    "tiny-mistral": ("tiny-mistral", {}),
    "tiny-qwen2": ("tiny-qwen2", {}),
    "tiny-qwen3": ("tiny-qwen3", {}),
    "tiny-gemma2": ("tiny-gemma2", {}),
    "tiny-gemma3": ("tiny-gemma3", {}),
    "tiny-phi3": ("tiny-phi3", {}),
    "llama-biases": ("tiny-llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral-window-48": ("tiny-mistral", {"sliding_window": 48}),
    "qwen2-window-40": (
        "tiny-qwen2",
        {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1},
    ),
    # Rope scaling whose original context (128) the prompts outrun: Qwen2.5's yarn and
    # Llama 3.1's llama3 frequencies.
    "qwen2-yarn": (
        "tiny-qwen2",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "llama-llama3-rope": (
        "tiny-llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
}
ARCHS = list(MODELS)
NUM_PROMPTS = 16


def model_path(name: str):
    base, overrides = MODELS[name]
    if not overrides:
        return resolve_model_source(f"builtin:{base}")
    return tiny_variant(base, **overrides)


def _prompts(vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """16 prompts with lengths spread over 1..300 and max_tokens up to 64."""
    rng = random.Random(seed)
    lengths = [1, 2, 7, 16, 17, 33, 64, 100, 128, 150, 199, 220, 256, 270, 299, 300]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    max_tokens = [rng.choice([1, 8, 16, 32, 48, 64]) for _ in lengths]
    # The two longest decode 64 tokens side by side: 2 x 23 blocks > the 40 blocks of the
    # preemption settings, whatever the seed drew for the others.
    max_tokens[-2:] = [64, 64]
    return prompts, max_tokens


def _shared_prefix_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(200)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(16)]


def _hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_tokens,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


class Reference:
    def __init__(self, arch: str) -> None:
        self.arch = arch
        self.path = model_path(arch)
        hf = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        vocab = hf.config.vocab_size
        self.prompts, self.max_tokens = _prompts(vocab, seed=ARCHS.index(arch))
        self.prefix_prompts = _shared_prefix_prompts(vocab, seed=7)
        with torch.no_grad():
            self.expected = [_hf_greedy(hf, p, m) for p, m in zip(self.prompts, self.max_tokens)]
            self.prefix_expected = [_hf_greedy(hf, p, 16) for p in self.prefix_prompts]


# The built-ins run in the fast tier; the config variants (biases, windows, rope scaling) only
# in the full suite.
@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=() if MODELS[name][1] == {} else pytest.mark.slow)
        for name in ARCHS
    ],
)
def ref(request: pytest.FixtureRequest) -> Reference:
    return Reference(request.param)


def _generate(ref: Reference, prompts: list[list[int]], max_tokens: list[int], **engine_args: Any):
    llm = LLM(str(ref.path), **engine_args)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


def _assert_all_blocks_released(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()
    stats = engine.get_kv_cache_stats()
    assert stats.free == stats.total, f"{stats.total - stats.free} blocks still held"
    assert engine.executor.collective_rpc("num_request_states") == [0]


def assert_setting_held(llm: LLM, setting: str) -> None:
    """The run under ``SETTINGS[setting]`` did what the setting is for (a preemption, a swap),
    and left every block free."""
    if setting.startswith("preempt"):
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the setting did not force preemption"
    if setting == "preempt_swap":
        assert llm.llm_engine.scheduler.num_swap_outs > 0, "preemption fell back to recompute"
    _assert_all_blocks_released(llm)


SETTINGS = {
    "defaults": {},
    "chunked_prefill": {"max_num_batched_tokens": 32, "max_num_seqs": 8},
    "preempt_recompute": {"num_kv_blocks": 40, "preemption_mode": "recompute"},
    "preempt_swap": {"num_kv_blocks": 40, "preemption_mode": "swap", "swap_space": 0.05},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_hf(ref: Reference, setting: str) -> None:
    llm, got = _generate(ref, ref.prompts, ref.max_tokens, **SETTINGS[setting])
    for i, (g, e) in enumerate(zip(got, ref.expected)):
        assert g == e, f"{ref.arch}/{setting}: prompt {i} (len {len(ref.prompts[i])}) differs"
    assert_setting_held(llm, setting)


def test_greedy_matches_hf_with_shared_prefix_cached(ref: Reference) -> None:
    llm, got = _generate(
        ref,
        ref.prefix_prompts,
        [16] * len(ref.prefix_prompts),
        enable_prefix_caching=True,
        max_num_seqs=2,
    )
    assert got == ref.prefix_expected
    assert llm.llm_engine.block_manager.prefix_hits > 0
    _assert_all_blocks_released(llm)


# ---- fields a config.json leaves out: transformers' defaults -------------------------------------


def checkpoint_without(out: Path, name: str, fields: tuple[str, ...], **overrides: Any) -> Path:
    """The tiny model ``name`` (with config ``overrides``) written to ``out``, then ``fields``
    removed from its config.json, as an older or hand-written config leaves them out: HF's
    config class gives them its defaults."""
    make = make_tiny_moe_model if name in TINY_MOE_MODEL_NAMES else make_tiny_model
    make(name, out, config_overrides=overrides)
    config = json.loads((out / "config.json").read_text())
    assert any(field in config for field in fields), f"{name} writes none of {fields}"
    for field in fields:
        config.pop(field, None)
    (out / "config.json").write_text(json.dumps(config))
    return out


def greedy_against_hf(
    path: Path,
    lengths: tuple[int, ...],
    max_tokens: int,
    reference: Path | None = None,
    **engine_args: Any,
) -> tuple[list[list[int]], list[list[int]]]:
    """(the engine's, HF's) greedy tokens in fp32 for prompts of ``lengths``: the engine serves
    ``path``, HF loads ``reference`` (default: the same checkpoint)."""
    hf = AutoModelForCausalLM.from_pretrained(reference or path, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(5, hf.config.vocab_size) for _ in range(n)] for n in lengths]
    with torch.no_grad():
        expected = [_hf_greedy(hf, p, max_tokens) for p in prompts]
    llm = LLM(str(path), dtype="float32", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], expected


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        # HF's Gemma2Config / Gemma3TextConfig: 256, i.e. scores scaled by 256^-0.5 whatever
        # the head dim (the tiny models' is 16).
        ("tiny-gemma2", ("query_pre_attn_scalar",)),
        ("tiny-gemma3", ("query_pre_attn_scalar",)),
        # MixtralConfig's rope_theta is 1e6, not the 10000 of configs in general.
        ("tiny-mixtral", ("rope_theta", "rope_parameters", "rope_scaling")),
    ],
)
def test_a_field_the_config_leaves_out_takes_transformers_default(
    tmp_path: Path, name: str, fields: tuple[str, ...]
) -> None:
    got, expected = greedy_against_hf(checkpoint_without(tmp_path, name, fields), (2, 17, 45), 16)
    assert got == expected


def test_gemma3_attention_softcap_is_refused_by_name(tmp_path: Path) -> None:
    """transformers' Gemma 3 keeps ``attn_logit_softcapping`` but passes it to none of its
    attention implementations (eager, sdpa, flex, flash): a config that sets it has no
    reference to be served exactly against."""
    make_tiny_model("tiny-gemma3", tmp_path, config_overrides={"attn_logit_softcapping": 5.0})
    with pytest.raises(ConfigError, match=r"^attn_logit_softcapping: 5.0 .*allowed: null"):
        LLM(str(tmp_path), dtype="float32")
