"""kv_cache_dtype="fp8" end to end: the engine's greedy output equals HF transformers token for
token (fp32) when HF's attention sees K/V rounded through float8_e4m3fn the same way
(``llm_kernels.kv_quant``: divide by the layer's scale, saturate, round; multiply back). That
reference is exact, not approximate: HF's attention is swapped for a registered one that
quantizes K/V (after rotary, which is what the engine caches) and then runs the model file's
own eager attention, so both sides attend over the very same values. Also: the checkpoint's
per-layer k/v scales are read, the cache holds >= 1.9x the blocks of a bf16 one for the same
memory, and bad values are refused by name."""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.config import EngineConfig
from engine.errors import ConfigError
from llm_kernels.kv_quant import dequantize_kv, quantize_kv

NUM_LAYERS = 2  # the tiny models' num_hidden_layers
_SCALES: dict[int, tuple[float, float]] = {}  # layer -> (k_scale, v_scale) for the reference


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    k_scale, v_scale = _SCALES.get(module.layer_idx, (1.0, 1.0))
    key = dequantize_kv(quantize_kv(key, k_scale), k_scale, key.dtype)
    value = dequantize_kv(quantize_kv(value, v_scale), v_scale, value.dtype)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("fp8_kv_reference", _fp8_kv_attention)
# The eager attention adds its mask to the scores, so it needs eager's additive float mask (an
# unregistered name would get SDPA's boolean one, or none at all).
AttentionMaskInterface.register("fp8_kv_reference", eager_mask)


def _prompts(vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(3)
    lengths = [1, 5, 16, 17, 40, 90, 130, 200]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths], [
        16,
        8,
        24,
        16,
        32,
        8,
        24,
        32,
    ]


def _hf_greedy(
    path: Path, scales: dict[int, tuple[float, float]], prompts, max_tokens, attn="fp8_kv_reference"
):
    _SCALES.clear()
    _SCALES.update(scales)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn
    ).eval()
    out = []
    with torch.no_grad():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            gen = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=n, pad_token_id=0,
            )  # fmt: skip
            out.append(gen[0, len(prompt) :].tolist())
    return out


def _engine_greedy(path: Path, prompts, max_tokens, **engine_args: Any):
    llm = LLM(str(path), **engine_args)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def _with_kv_scales(base: Path, out: Path, scales: dict[int, tuple[float, float]]) -> Path:
    """``base`` plus a second safetensors file holding compressed-tensors-style scales (HF's
    loader reads model.safetensors only, so the reference gets them through _SCALES)."""
    shutil.copytree(base, out)
    tensors = {}
    for layer, (k, v) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v])
    save_file(tensors, out / "kv_scales.safetensors")
    return out


SETTINGS = {
    "defaults": {},
    "chunked_prefill_swap": {
        "max_num_batched_tokens": 32, "max_num_seqs": 4, "num_kv_blocks": 24,
        "preemption_mode": "swap", "swap_space": 0.05,
    },
}  # fmt: skip


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma2"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fp8_cache_greedy_equals_hf_with_fp8_rounded_kv(model: str, setting: str) -> None:
    path = resolve_model_source(f"builtin:{model}")
    prompts, max_tokens = _prompts(vocab=256)
    expected = _hf_greedy(path, {}, prompts, max_tokens)
    llm, got = _engine_greedy(path, prompts, max_tokens, kv_cache_dtype="fp8", **SETTINGS[setting])
    model_config = llm.llm_engine.config.model
    one_byte_per_element = (
        2 * 16 * model_config.num_kv_heads * model_config.head_dim * model_config.num_hidden_layers
    )
    assert llm.llm_engine.executor.collective_rpc("kv_block_bytes") == [one_byte_per_element]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{model}/{setting}: prompt {i} (len {len(prompts[i])}) differs"
    if setting != "defaults":
        assert llm.llm_engine.scheduler.num_swap_outs > 0, "the setting did not swap fp8 blocks"


@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-deepseek-v2"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fp8_latent_cache_greedy_equals_hf_with_the_latent_fp8_rounded(
    model: str, setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLA caches the normalized latent and the roped key, one byte each: HF's DeepSeek
    attention is given exactly those rounded (its ``expand_kv`` receives them after the cache
    update and before the up-projection), with the scale the engine uses when the checkpoint
    has none (1.0)."""
    import importlib

    family = model.removeprefix("tiny-").replace("-", "_")
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    attention = getattr(module, f"{family.title().replace('_', '')}Attention")
    expand_kv = attention.expand_kv

    def expand_rounded(self, kv_nope: torch.Tensor, k_rot: torch.Tensor):
        def rounded(x: torch.Tensor) -> torch.Tensor:
            return dequantize_kv(quantize_kv(x, 1.0), 1.0, x.dtype)

        return expand_kv(self, rounded(kv_nope), rounded(k_rot))

    monkeypatch.setattr(attention, "expand_kv", expand_rounded)
    path = resolve_model_source(f"builtin:{model}")
    prompts, max_tokens = _prompts(vocab=256)
    expected = _hf_greedy(path, {}, prompts, max_tokens, attn="eager")
    llm, got = _engine_greedy(path, prompts, max_tokens, kv_cache_dtype="fp8", **SETTINGS[setting])
    hf = llm.llm_engine.config.model.hf_config
    latent = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
    assert llm.llm_engine.executor.collective_rpc("kv_block_bytes") == [
        16 * latent * hf["num_hidden_layers"]
    ]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{model}/{setting}: prompt {i} (len {len(prompts[i])}) differs"
    if setting != "defaults":
        assert llm.llm_engine.scheduler.num_swap_outs > 0, "the setting did not swap fp8 blocks"


def test_checkpoint_kv_scales_are_used(tmp_path: Path) -> None:
    scales = {0: (0.02, 0.5), 1: (0.3, 0.01)}
    path = _with_kv_scales(resolve_model_source("builtin:tiny-llama"), tmp_path / "m", scales)
    prompts, max_tokens = _prompts(vocab=256)
    expected = _hf_greedy(path, scales, prompts, max_tokens)
    _, got = _engine_greedy(
        path, prompts, max_tokens, kv_cache_dtype="fp8_e4m3", enable_prefix_caching=True
    )
    assert got == expected
    # The scales matter: with 1.0 everywhere the reference differs on some prompt.
    assert _hf_greedy(path, {}, prompts, max_tokens) != expected
    # The default cache loads the same checkpoint and ignores them, as vLLM does.
    _, auto = _engine_greedy(path, prompts[:3], max_tokens[:3])
    assert auto == _hf_greedy(path, {}, prompts[:3], max_tokens[:3], attn="eager")


def test_fp8_cache_holds_at_least_1_9x_the_blocks_of_bf16() -> None:
    path = resolve_model_source("builtin:tiny-llama")
    blocks = {}
    for kv_dtype in ("auto", "fp8"):
        llm = LLM(str(path), dtype="bfloat16", kv_cache_dtype=kv_dtype, cpu_kv_cache_space=0.002)
        blocks[kv_dtype] = llm.llm_engine.get_kv_cache_stats().total
    assert blocks["fp8"] >= 1.9 * blocks["auto"], blocks


@pytest.mark.parametrize("value", ["fp8_e5m2", "int8", None, 8])
def test_bad_kv_cache_dtype_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(
        ConfigError, match="kv_cache_dtype: must be one of 'auto', 'fp8', 'fp8_e4m3'"
    ):
        EngineConfig.from_kwargs(model="builtin:tiny-llama", kv_cache_dtype=value)


def test_a_bad_checkpoint_scale_is_refused_with_its_name(tmp_path: Path) -> None:
    path = _with_kv_scales(
        resolve_model_source("builtin:tiny-llama"), tmp_path / "m", {0: (-1.0, 1.0)}
    )
    with pytest.raises(
        ValueError, match=r"model.layers.0.self_attn.k_scale: must be a finite number > 0"
    ):
        LLM(str(path), kv_cache_dtype="fp8")


def test_memory_plan_counts_the_fp8_cache_like_the_engine() -> None:
    from engine.config_sections import CacheConfig
    from engine.worker.memory_plan import plan_memory
    from engine.worker.memory_plan_estimates import PlanSettings
    from engine.worker.worker import Worker

    assert PlanSettings().kv_cache_dtype == CacheConfig().cache_dtype
    # A budget of ~52 bf16 blocks, under the cap of max_num_seqs full-length sequences.
    kwargs = {"max_model_len": 512, "max_num_seqs": 64, "cpu_kv_cache_space": 0.0002}
    plans = {}
    for kv_dtype in ("auto", "fp8"):
        args = {**kwargs, "kv_cache_dtype": kv_dtype, "dtype": "bfloat16"}
        config = EngineConfig.from_kwargs(model="builtin:tiny-llama", device="cpu", **args)
        worker = Worker(config)
        worker.init_device()
        worker.load_model()
        plan = plan_memory(config.model.hf_config, PlanSettings.from_engine_kwargs(args, "cpu"))
        assert plan.stages[0].kv_block_bytes == worker.kv_block_bytes()
        assert plan.kv_blocks == worker.determine_num_available_blocks()[0]
        plans[kv_dtype] = plan
    assert plans["fp8"].kv_blocks >= 1.9 * plans["auto"].kv_blocks


def test_memory_plan_of_llama_70b_at_tp4_holds_about_twice_the_tokens_with_fp8() -> None:
    from engine.worker.memory_plan import plan_memory
    from engine.worker.memory_plan_estimates import PlanSettings
    from tests.engine.worker.test_memory_plan import H100_BYTES, LLAMA_3_70B

    kwargs = {"tensor_parallel_size": 4, "dtype": "bfloat16", "max_model_len": 8192}
    blocks = {}
    for kv_dtype in ("auto", "fp8"):
        settings = PlanSettings.from_engine_kwargs({**kwargs, "kv_cache_dtype": kv_dtype}, "cuda")
        plan = plan_memory(LLAMA_3_70B, settings, H100_BYTES)
        assert plan.stages[0].kv_bytes_per_token == 80 * 2 * 2 * 128 * (
            2 if kv_dtype == "auto" else 1
        )
        blocks[kv_dtype] = plan.kv_blocks
    assert blocks["fp8"] >= 1.9 * blocks["auto"], blocks


def test_triton_backend_with_fp8_cache_generates_the_torch_backends_tokens() -> None:
    # The Triton interpreter on CPU; a 16-token budget mixes prefill chunks and decodes.
    path = resolve_model_source("builtin:tiny-llama")
    prompts, max_tokens = _prompts(vocab=256)
    prompts, max_tokens = [prompts[1], prompts[3]], [6, 6]
    args = {"kv_cache_dtype": "fp8", "max_num_batched_tokens": 16, "num_kv_blocks": 32}
    _, torch_tokens = _engine_greedy(path, prompts, max_tokens, attention_backend="torch", **args)
    _, triton_tokens = _engine_greedy(path, prompts, max_tokens, attention_backend="triton", **args)
    assert triton_tokens == torch_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_fp8_cache_with_and_without_cuda_graphs_equals_hf(
    tmp_path: Path, enforce_eager
) -> None:
    scales = {0: (0.02, 0.5), 1: (0.3, 0.01)}
    path = _with_kv_scales(resolve_model_source("builtin:tiny-llama"), tmp_path / "m", scales)
    prompts, max_tokens = _prompts(vocab=256)
    expected = _hf_greedy(path, scales, prompts, max_tokens)
    _, got = _engine_greedy(
        path, prompts, max_tokens, kv_cache_dtype="fp8", device="cuda", dtype="float32",
        attention_backend="triton", enforce_eager=enforce_eager,
    )  # fmt: skip
    assert got == expected


def test_kv_scale_names_load_into_their_layers_only() -> None:
    from engine.worker.kv_cache_scales import is_kv_scale_name, load_kv_scale

    path = resolve_model_source("builtin:tiny-llama")
    llm = LLM(str(path), kv_cache_dtype="fp8", num_kv_blocks=8)
    model = llm.llm_engine.executor.worker.runner.model
    layers = model.attention_layers()
    load_kv_scale(model, "model.layers.1.self_attn.kv_scale", torch.tensor([0.25]), NUM_LAYERS)
    assert (layers[1].k_scale, layers[1].v_scale, layers[0].k_scale) == (0.25, 0.25, 1.0)
    assert not is_kv_scale_name("model.layers.0.self_attn.k_proj.weight_scale")
    with pytest.raises(ValueError, match="layer 2 does not exist"):
        load_kv_scale(model, "model.layers.2.self_attn.k_scale", torch.tensor(1.0), NUM_LAYERS)
    with pytest.raises(ValueError, match=r"k_scale: must be one value per tensor"):
        load_kv_scale(model, "model.layers.0.self_attn.k_scale", torch.ones(4), NUM_LAYERS)
