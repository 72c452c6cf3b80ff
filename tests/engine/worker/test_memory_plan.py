"""``engine.worker.memory_plan`` against the model code itself: for every (TP rank, PP stage) the
plan's weight and buffer bytes equal a meta-device build's parameters and buffers exactly, its KV
bytes per token equal the model runner's, and against a real tiny engine on CPU; plus its
refusals."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.builtin.catalog import resolve_model_source
from engine.config import EngineConfig
from engine.models import MODEL_REGISTRY
from engine.vlm_config import flatten_vlm_config
from engine.worker.memory_plan import plan_memory
from engine.worker.memory_plan_estimates import CUDA_CONTEXT_BYTES, GiB, PlanSettings
from engine.worker.memory_plan_weights import FAMILIES
from engine.worker.model_loader import _default_dtype
from engine.worker.model_runner import ModelRunner
from llm_kernels.backend import get_kernel_ops
from parallel.lora import LoRABatch, attach_lora
from parallel.state import GroupCoordinator, ParallelContext

# Meta-Llama-3-70B(-Instruct)'s config.json, as published (no weights needed).
LLAMA_3_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128009,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 28672,
    "max_position_embeddings": 8192,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
# DeepSeek-V3's and Kimi K2's config.json as published (block-FP8 checkpoints).
_BLOCK_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [128, 128]}  # fmt: skip
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "quantization_config": _BLOCK_FP8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
KIMI_K2: dict[str, Any] = {
    **DEEPSEEK_V3, "model_type": "kimi_k2", "bos_token_id": 163584, "eos_token_id": 163585,
    "first_k_dense_replace": 1, "max_position_embeddings": 131072, "n_group": 1,
    "n_routed_experts": 384, "num_attention_heads": 64, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0, "routed_scaling_factor": 2.827, "topk_group": 1,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 50000.0, "vocab_size": 163840,
}  # fmt: skip
# GLM-4.6's published config.json (GLM-4.5's shape with a longer context).
GLM_4_6: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 202752,
    "model_type": "glm4_moe", "moe_intermediate_size": 1536, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "num_hidden_layers": 92, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_qk_norm": True, "vocab_size": 151552,
}  # fmt: skip


def gpt_oss_config(num_layers: int, num_experts: int) -> dict[str, Any]:
    """gpt-oss-120b's config.json as published (36 layers, 128 experts); gpt-oss-20b's differs
    in those two (24, 32)."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (num_layers // 2),
        "max_position_embeddings": 131072, "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": num_layers, "num_key_value_heads": 8,
        "num_local_experts": num_experts, "output_router_logits": False,
        "pad_token_id": 199999, "quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": 201088,
    }  # fmt: skip


GPT_OSS_120B = gpt_oss_config(36, 128)
GPT_OSS_20B = gpt_oss_config(24, 32)
# The same shapes in bf16: a meta build has no quantized layers to compare with.
DEEPSEEK_V3_BF16 = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}
# configs/llama70b.yaml's engine_kwargs that change memory.
LLAMA_70B_KWARGS = {
    "tensor_parallel_size": 4,
    "pipeline_parallel_size": 2,
    "dtype": "bfloat16",
    "max_model_len": 8192,
    "gpu_memory_utilization": 0.9,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
}
H100_BYTES = int(79.19 * GiB)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def write_config(directory: Path, hf: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    return directory


def builtin_config(name: str, **overrides: Any) -> dict[str, Any]:
    hf = json.loads((resolve_model_source(f"builtin:{name}") / "config.json").read_text())
    hf = {**hf, **overrides}
    if "num_hidden_layers" in overrides and hf.get("layer_types"):
        types = hf["layer_types"]
        hf["layer_types"] = [types[i % len(types)] for i in range(hf["num_hidden_layers"])]
    return hf


def meta_rank(
    hf: dict[str, Any], dtype: str, tp: int, tp_rank: int, pp: int, pp_rank: int,
    partition: tuple[int, ...] | None = None, expert_parallel: bool = False,
    backend: str = "torch", dp: int = 1, dp_rank: int = 0,
) -> torch.nn.Module:  # fmt: skip
    """One rank's model built the way ``model_loader.load_model`` builds it, on meta, with the
    kernels of ``backend`` (MXFP4 experts stay MXFP4 on Triton's); with ``dp`` > 1, DP rank
    ``dp_rank``'s, its experts a share of the EP group over all DP x TP ranks."""
    ep = None
    if dp > 1:
        ranks = tuple(range(dp * tp))
        ep = GroupCoordinator(rank=dp_rank * tp + tp_rank, size=dp * tp, ranks=ranks)
    ctx = ParallelContext(
        tp=GroupCoordinator(rank=tp_rank, size=tp, ranks=tuple(range(tp))),
        pp=GroupCoordinator(rank=pp_rank, size=pp, ranks=tuple(range(pp))),
        layer_partition=partition,
        expert_parallel=expert_parallel,
        ep=ep,
    )
    model_class = MODEL_REGISTRY[hf["architectures"][0]]
    with torch.device("meta"), _default_dtype(_DTYPES[dtype]):
        return model_class(hf, ctx, ops=get_kernel_ops(backend))


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def runner_kv_bytes_per_token(
    model: torch.nn.Module, model_dir: Path, kwargs: dict[str, Any]
) -> int:
    """``CacheEngine.block_bytes`` of ``model`` over the block size."""
    config = EngineConfig.from_kwargs(model=str(model_dir), device="cpu", **kwargs)
    runner = ModelRunner(config, model, torch.device("meta"))
    return runner.cache_engine.block_bytes() // config.cache.block_size


def check_against_meta_builds(
    tmp_path: Path, hf: dict[str, Any], kwargs: dict[str, Any], backend: str = "torch"
) -> None:
    """Every (TP rank, PP stage): the plan's stage figures equal the meta build's (the ranks
    built with ``backend``'s kernels, those of the plan's CUDA device)."""
    model_dir = write_config(tmp_path / "model", hf)
    plan = plan_memory(hf, PlanSettings.from_engine_kwargs(kwargs, "cuda"), H100_BYTES)
    tp = kwargs.get("tensor_parallel_size", 1)
    pp = kwargs.get("pipeline_parallel_size", 1)
    partition = kwargs.get("pp_layer_partition")
    partition = tuple(partition) if partition else None
    ep = kwargs.get("enable_expert_parallel", False)
    dp = kwargs.get("data_parallel_size", 1)
    assert len(plan.stages) == pp
    ranks = [(stage, d, t) for stage in plan.stages for d in range(dp) for t in range(tp)]
    for stage, dp_rank, tp_rank in ranks:
        model = meta_rank(
            hf, plan.dtype, tp, tp_rank, pp, stage.pp_rank, partition, ep, backend,
            dp, dp_rank,
        )  # fmt: skip
        where = f"dp rank {dp_rank}, tp rank {tp_rank}, pp stage {stage.pp_rank}"
        assert stage.weight_bytes == tensor_bytes(model.parameters()), where
        assert stage.buffer_bytes == tensor_bytes(model.buffers()), where
        assert (model.model.start_layer, model.model.end_layer) == (
            stage.first_layer,
            stage.end_layer,
        ), where
        per_token = runner_kv_bytes_per_token(model, model_dir, kwargs)
        assert stage.kv_bytes_per_token == per_token, where


def test_llama_3_70b_at_tp4_pp2_matches_a_meta_build_of_every_rank(tmp_path: Path) -> None:
    check_against_meta_builds(tmp_path, LLAMA_3_70B, LLAMA_70B_KWARGS)


def test_llama_3_70b_at_tp4_pp2_figures(tmp_path: Path) -> None:
    """The numbers themselves, worked by hand: per GPU 41 layers (stage 0) and 39 (stage 1,
    which also runs the LM head: the balanced default) of (q 16 + k 2 + v 2 heads x 128 x 8192
    + o 8192 x 2048 + gate_up 14336 x 8192 + down 8192 x 7168) bf16."""
    plan = plan_memory(
        LLAMA_3_70B, PlanSettings.from_engine_kwargs(LLAMA_70B_KWARGS, "cuda"), H100_BYTES
    )
    layer = (20 * 128 * 8192 + 8192 * 2048 + 14336 * 8192 + 8192 * 7168 + 2 * 8192) * 2
    table = 128256 // 4 * 8192 * 2  # 128256 is a multiple of 64 x 4: no padding
    first, last = plan.stages
    assert (first.num_layers, last.num_layers) == (41, 39)
    assert first.weight_bytes == 41 * layer + table
    assert last.weight_bytes == 39 * layer + table + 8192 * 2  # LM head and final norm
    assert first.buffer_bytes == last.buffer_bytes == 2 * 8192 * 128 * 4
    assert first.kv_bytes_per_token == 41 * 2 * 2 * 128 * 2 == 41984
    assert plan.fits and plan.problems == ()
    # ~16.8 GiB of weights per GPU leaves ~52 GiB for the cache: over a million tokens.
    assert plan.kv_tokens is not None and plan.kv_tokens > 1_300_000
    assert plan.max_concurrent_sequences == plan.kv_tokens // 8192
    assert plan.kv_blocks == min(s.kv_blocks for s in plan.stages)
    usable = int(H100_BYTES * 0.9)
    for stage in plan.stages:
        assert stage.kv_blocks == (usable - stage.fixed_bytes) // stage.kv_block_bytes


@pytest.mark.parametrize(
    ("name", "overrides", "kwargs"),
    [
        # qk-norm, head_dim != hidden / heads, q/k/v/o biases; uneven PP partition.
        ("tiny-qwen3", {"num_hidden_layers": 5, "attention_bias": True},
         {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "pp_layer_partition": [4, 1]}),
        # Tied embeddings split across stages (the last stage has its own head), soft-caps.
        ("tiny-gemma2", {}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
        # Tied embeddings on one stage: one tensor.
        ("tiny-gemma2", {}, {"tensor_parallel_size": 2}),
        # Two ropes (local and global); stage 0 holds only sliding layers, so one table.
        ("tiny-gemma3", {}, {"pipeline_parallel_size": 3}),
        # Fused qkv/gate_up in the checkpoint, partial rotary, longrope.
        ("tiny-phi3", {}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
        # TP 4 > 2 KV heads (each replicated on two ranks), every bias, a vocab padded to 256.
        ("tiny-llama", {"attention_bias": True, "mlp_bias": True, "vocab_size": 1000},
         {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}),
        # Qwen2's q/k/v biases with tied embeddings, float16, an even 3-stage split of 5.
        ("tiny-qwen2", {"num_hidden_layers": 5},
         {"pipeline_parallel_size": 3, "dtype": "float16", "tensor_parallel_size": 2}),
        ("tiny-mistral", {}, {"dtype": "bfloat16"}),
        # MoE: experts sliced (TP) or whole per rank (EP); a shared expert; dense layers among
        # sparse ones (mlp_only_layers, decoder_sparse_step) split over stages.
        ("tiny-mixtral", {}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
        ("tiny-mixtral", {}, {"tensor_parallel_size": 4, "enable_expert_parallel": True}),
        ("tiny-qwen2-moe", {"decoder_sparse_step": 2, "num_hidden_layers": 3},
         {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
        ("tiny-qwen2-moe", {}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
        ("tiny-qwen3-moe", {}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                "enable_expert_parallel": True, "dtype": "bfloat16"}),
        # Multi-head latent attention: the latent cache whole on every rank, heads split;
        # a dense layer then sparse ones split over stages; V3's float32 router and bias.
        ("tiny-deepseek-v3", {}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
        ("tiny-deepseek-v3", {"attention_bias": True, "rope_interleave": False},
         {"tensor_parallel_size": 4, "enable_expert_parallel": True, "dtype": "bfloat16"}),
        ("tiny-deepseek-v2", {}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 3}),
        # GLM-4.5: q/k norm and q/k/v biases (no o bias), DeepSeek's float32 router and
        # correction bias, a shared expert; Air's shape without the norm, experts whole.
        ("tiny-glm4-moe", {}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
        ("tiny-glm4-moe", {"use_qk_norm": False},
         {"tensor_parallel_size": 2, "enable_expert_parallel": True, "dtype": "bfloat16"}),
        # gpt-oss: float32 sinks split by heads, q/k/v/o biases, a biased router, expert
        # biases (gate_up's sliced, down's whole on every rank) under TP and EP.
        ("tiny-gpt-oss", {}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
        ("tiny-gpt-oss", {},
         {"tensor_parallel_size": 4, "enable_expert_parallel": True, "dtype": "bfloat16"}),
        # Data-parallel attention: each DP rank's TP group holds every layer, the experts a
        # share of all DP x TP ranks.
        ("tiny-qwen3-moe", {}, {"tensor_parallel_size": 2, "data_parallel_size": 2,
                                "enable_expert_parallel": True, "dtype": "bfloat16"}),
        ("tiny-deepseek-v3", {}, {"tensor_parallel_size": 2, "data_parallel_size": 4,
                                  "enable_expert_parallel": True}),
    ],
)  # fmt: skip
def test_every_family_matches_a_meta_build_of_every_rank(
    tmp_path: Path, name: str, overrides: dict[str, Any], kwargs: dict[str, Any]
) -> None:
    check_against_meta_builds(tmp_path, builtin_config(name, **overrides), kwargs)


def test_llava_counts_its_vision_tower_on_every_rank_as_a_meta_build(tmp_path: Path) -> None:
    # The tower up to vision_feature_layer and the projector, replicated on both TP ranks.
    hf = flatten_vlm_config(builtin_config("tiny-llava"))
    check_against_meta_builds(tmp_path, hf, {"tensor_parallel_size": 2})
    plan = plan_memory(builtin_config("tiny-llava"), PlanSettings(), H100_BYTES)
    assert plan.problems == ()


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_qwen_vl_counts_its_vision_tower_on_every_rank_as_a_meta_build(
    tmp_path: Path, name: str
) -> None:
    # The tower with its merger(s) (Qwen3-VL: deepstack mergers and position table too),
    # replicated on both TP ranks.
    hf = flatten_vlm_config(builtin_config(name))
    check_against_meta_builds(tmp_path, hf, {"tensor_parallel_size": 2})
    plan = plan_memory(builtin_config(name), PlanSettings(), H100_BYTES)
    assert plan.problems == ()


def test_gemma3_vision_counts_its_tower_on_every_rank_as_a_meta_build(tmp_path: Path) -> None:
    # SigLIP (no class token, post_layernorm) and Gemma 3's projector, on both TP ranks.
    hf = flatten_vlm_config(builtin_config("tiny-gemma3-vision"))
    check_against_meta_builds(tmp_path, hf, {"tensor_parallel_size": 2})
    plan = plan_memory(builtin_config("tiny-gemma3-vision"), PlanSettings(), H100_BYTES)
    assert plan.problems == ()


@pytest.mark.parametrize(
    ("kwargs", "backend"),
    [
        # TP 2: each rank's 16 down_proj inputs (of 32) in one group, rank 1's from value 16.
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "triton"),
        ({"tensor_parallel_size": 4, "enable_expert_parallel": True, "dtype": "bfloat16"},
         "triton"),
        # The torch kernels on CUDA dequantize the experts at load.
        ({"tensor_parallel_size": 2, "attention_backend": "torch"}, "torch"),
    ],
)  # fmt: skip
def test_mxfp4_gpt_oss_matches_a_meta_build_of_every_rank(
    tmp_path: Path, kwargs: dict[str, Any], backend: str
) -> None:
    hf = builtin_config("tiny-gpt-oss", quantization_config={"quant_method": "mxfp4"})
    check_against_meta_builds(tmp_path, hf, kwargs, backend)


def test_gpt_oss_120b_keeps_mxfp4_experts_and_fits_one_h100() -> None:
    """Worked by hand: an expert's gate_up [5760, 2880] and down [2880, 2880] as 17 bytes per
    32 weights (16 of E2M1 codes, one E8M0 scale), its biases 5760 + 2880 in bf16; 36 layers of
    128. With the bf16 rest (~4 GiB) that is ~60.8 GiB: an 80 GB H100 holds it and a cache of
    one full 131072-token sequence at gpu_memory_utilization 0.92."""
    expert = (5760 * 90 + 2880 * 90) * 17 + (5760 + 2880) * 2
    kwargs = {"dtype": "bfloat16", "max_model_len": 131072, "gpu_memory_utilization": 0.92}
    plan = plan_memory(GPT_OSS_120B, PlanSettings.from_engine_kwargs(kwargs, "cuda"), H100_BYTES)
    (stage,) = plan.stages
    assert stage.weight_breakdown["experts"] == 36 * 128 * expert
    assert 60 * GiB < stage.weight_bytes < 61 * GiB
    assert stage.kv_bytes_per_token == 36 * 2 * 8 * 64 * 2
    assert plan.fits and plan.kv_tokens is not None and plan.kv_tokens > 131072
    assert plan.notes == ()
    # gpt-oss-20b: 24 layers of 32 experts, ~12.8 GiB, a cache of over a million tokens.
    small = plan_memory(GPT_OSS_20B, PlanSettings.from_engine_kwargs(kwargs, "cuda"), H100_BYTES)
    assert small.stages[0].weight_breakdown["experts"] == 24 * 32 * expert
    assert small.fits and small.kv_tokens is not None and small.kv_tokens > 1_000_000


def test_gpt_oss_120b_experts_count_dequantized_where_the_engine_dequantizes() -> None:
    """On CPU and with the torch kernels on CUDA: bf16 experts, ~214 GiB, and a note."""
    expert = 3 * 2880 * 2880 * 2 + (5760 + 2880) * 2
    for settings in (
        PlanSettings(dtype="bfloat16", device="cpu", max_model_len=4096),
        PlanSettings(dtype="bfloat16", attention_backend="torch", max_model_len=4096),
    ):
        plan = plan_memory(GPT_OSS_120B, settings, H100_BYTES)
        assert plan.stages[0].weight_breakdown["experts"] == 36 * 128 * expert
        assert any("mxfp4 experts counted dequantized" in n for n in plan.notes)


def test_deepseek_v3_at_tp8_pp2_matches_a_meta_build_of_every_rank(tmp_path: Path) -> None:
    kwargs = {"tensor_parallel_size": 8, "pipeline_parallel_size": 2, "dtype": "bfloat16",
              "max_model_len": 32768, "enable_expert_parallel": True}  # fmt: skip
    check_against_meta_builds(tmp_path, DEEPSEEK_V3_BF16, kwargs)


def test_glm_4_6_at_tp8_with_experts_whole_matches_a_meta_build_of_every_rank(
    tmp_path: Path,
) -> None:
    kwargs = {"tensor_parallel_size": 8, "dtype": "bfloat16", "max_model_len": 131072,
              "enable_expert_parallel": True}  # fmt: skip
    check_against_meta_builds(tmp_path, GLM_4_6, kwargs)


def test_deepseek_v3_latent_cache_figures() -> None:
    """By hand: 576 values (512 latent + 64 rope) per token and layer, bf16, the same on every
    TP rank: 61 layers x 576 x 2 = 70,272 bytes (~69 KiB) per token for the whole model,
    where 128 heads of expanded K (192) and V (128) would be 61 x 128 x 320 x 2 = ~4.8 MiB."""
    settings = PlanSettings(tensor_parallel_size=8, dtype="bfloat16", max_model_len=32768)
    plan = plan_memory(DEEPSEEK_V3_BF16, settings, 141 * GiB)
    (stage,) = plan.stages
    assert stage.kv_bytes_per_token == 61 * 576 * 2 == 70272
    assert 61 * 128 * (192 + 128) * 2 / stage.kv_bytes_per_token == pytest.approx(71.1, abs=0.1)


def test_a_tp_size_the_layers_cannot_split_is_a_problem_as_in_the_model_code() -> None:
    # 4 KV heads over 3 ranks: neither divides the other (QKVParallelLinear refuses it too).
    hf = builtin_config("tiny-llama", num_attention_heads=6, num_key_value_heads=4, head_dim=16)
    plan = plan_memory(hf, PlanSettings(tensor_parallel_size=3), H100_BYTES)
    assert plan.stages == () and not plan.fits
    assert "num_key_value_heads (4), got 3" in plan.problems[-1]
    with pytest.raises(ValueError, match="num_key_value_heads"):
        meta_rank(hf, "float32", 3, 0, 1, 0)


def test_every_registered_family_has_a_memory_model() -> None:
    assert set(FAMILIES) == set(MODEL_REGISTRY)


def test_lora_slots_match_what_attach_lora_allocates() -> None:
    hf = builtin_config("tiny-llama")
    kwargs = {"tensor_parallel_size": 2, "enable_lora": True, "max_loras": 3, "max_lora_rank": 8}
    plan = plan_memory(hf, PlanSettings.from_engine_kwargs(kwargs, "cuda"), H100_BYTES)
    model = meta_rank(hf, plan.dtype, 2, 1, 1, 0)
    layers = attach_lora(
        model, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 3, 8,
        LoRABatch(lambda *args: None, torch.device("meta")),
    )  # fmt: skip
    allocated = sum(tensor_bytes(iter((lo.lora_a, lo.lora_b))) for lo in layers.values())
    assert plan.stages[0].lora_bytes == allocated > 0


def test_engine_defaults_are_the_plans() -> None:
    from engine.config_sections import CacheConfig, LoRAConfig, SchedulerConfig

    defaults = PlanSettings()
    assert defaults.block_size == CacheConfig().block_size
    assert defaults.gpu_memory_utilization == CacheConfig().gpu_memory_utilization
    assert defaults.cpu_kv_cache_space == CacheConfig().cpu_kv_cache_space
    assert defaults.max_num_seqs == SchedulerConfig().max_num_seqs
    assert defaults.max_loras == LoRAConfig().max_loras
    assert defaults.max_lora_rank == LoRAConfig().max_lora_rank


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-phi3"])
def test_a_real_tiny_engine_on_cpu_holds_what_the_plan_says(name: str) -> None:
    from engine.worker.worker import Worker

    kwargs = {"max_model_len": 512, "max_num_seqs": 4, "cpu_kv_cache_space": 0.001}
    config = EngineConfig.from_kwargs(model=f"builtin:{name}", device="cpu", **kwargs)
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    hf = config.model.hf_config
    plan = plan_memory(hf, PlanSettings.from_engine_kwargs(kwargs, "cpu"))
    (stage,) = plan.stages
    assert stage.weight_bytes == worker.parameter_bytes()
    assert stage.buffer_bytes == tensor_bytes(worker.runner.model.buffers())
    assert stage.kv_block_bytes == worker.kv_block_bytes()
    assert plan.kv_blocks == worker.determine_num_available_blocks()[0]
    assert stage.reserve_bytes == 0


def test_llama_70b_on_one_h100_is_refused_for_its_weights() -> None:
    kwargs = {**LLAMA_70B_KWARGS, "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    plan = plan_memory(LLAMA_3_70B, PlanSettings.from_engine_kwargs(kwargs, "cuda"), H100_BYTES)
    assert not plan.fits
    (problem,) = plan.problems
    weights = plan.stages[0].weight_bytes
    assert weights == 70_553_706_496 * 2  # Llama-3-70B's 70.55 B parameters in bf16
    assert f"weights {weights / GiB:.2f} GiB" in problem
    assert "usable 71.27 GiB (79.19 GiB x gpu_memory_utilization 0.9)" in problem
    assert "tensor_parallel_size" in problem


def test_a_kv_cache_shorter_than_one_sequence_is_refused_naming_the_numbers() -> None:
    # Llama-3-70B with rope scaled to 32k at TP 2 on H100s: ~65.7 GiB of weights per GPU leave
    # ~2.3 GiB for the cache once the step and reserves are counted: ~15k tokens of 160 KiB
    # each (80 layers x K, V x 4 KV heads x 128 x bf16).
    rope_scaled = {**LLAMA_3_70B, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    kwargs = {**LLAMA_70B_KWARGS, "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
              "max_model_len": 32768}  # fmt: skip
    plan = plan_memory(rope_scaled, PlanSettings.from_engine_kwargs(kwargs, "cuda"), H100_BYTES)
    assert not plan.fits and plan.kv_tokens is not None and 0 < plan.kv_tokens < 32768
    (problem,) = plan.problems
    assert f"holds {plan.kv_tokens} tokens per replica" in problem
    assert "80 layers x 160 KiB per token" in problem
    assert "max_model_len 32768" in problem and "lower max_model_len" in problem
    shorter = {**kwargs, "max_model_len": plan.kv_tokens}
    assert plan_memory(
        rope_scaled, PlanSettings.from_engine_kwargs(shorter, "cuda"), H100_BYTES
    ).fits


def test_a_cpu_cache_too_small_for_max_model_len_is_refused() -> None:
    hf = builtin_config("tiny-llama")
    plan = plan_memory(hf, PlanSettings(device="cpu", num_kv_blocks=8, max_model_len=512))
    (problem,) = plan.problems
    assert "holds 128 tokens" in problem and "max_model_len 512" in problem
    assert "num_kv_blocks" in problem


def test_a_config_the_engine_refuses_is_a_problem_and_quantized_weights_are_sized() -> None:
    settings = PlanSettings.from_engine_kwargs(
        {**LLAMA_70B_KWARGS, "tensor_parallel_size": 2, "pipeline_parallel_size": 1}, "cuda"
    )
    bnb = {**LLAMA_3_70B, "quantization_config": {"quant_method": "bitsandbytes"}}
    refused = plan_memory(bnb, settings, H100_BYTES)
    assert any("quant_method 'bitsandbytes' is not supported" in p for p in refused.problems)
    gptq = {**LLAMA_3_70B, "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}}  # fmt: skip
    plan = plan_memory(gptq, settings, H100_BYTES)
    assert not plan.problems
    # Kept on the GPU as int4 packed in int32s, a float16 scale and an int8 zero point per 128
    # inputs: the down projection of one rank is [8192, 14336].
    down = 8192 * 14336 // 2 + 8192 * 112 * (2 + 1)
    unquantized = plan_memory(LLAMA_3_70B, settings, H100_BYTES).stages[0]
    stage = plan.stages[0]
    assert stage.weight_breakdown["embedding"] == unquantized.weight_breakdown["embedding"]
    assert stage.weight_breakdown["mlp"] < unquantized.weight_breakdown["mlp"] / 3
    assert down * 80 < stage.weight_breakdown["mlp"]
    # FP8 (compressed-tensors per channel, or online fp8): a byte per weight and a float32
    # scale per output row, gate_up's 2 x 14336 rows and down's 8192 on each rank.
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
             "strategy": "channel"}, "input_activations": {"num_bits": 8, "type": "float",
             "strategy": "token", "dynamic": True}}  # fmt: skip
    fp8 = {**LLAMA_3_70B, "quantization_config": {"quant_method": "compressed-tensors",
           "format": "float-quantized", "config_groups": {"g": group}}}  # fmt: skip
    fp8_stage = plan_memory(fp8, settings, H100_BYTES).stages[0]
    linear_elements = unquantized.weight_breakdown["mlp"] // 2
    expected = linear_elements + 80 * (2 * 14336 + 8192) * 4
    assert fp8_stage.weight_breakdown["mlp"] == expected
    online_kwargs = {**LLAMA_70B_KWARGS, "tensor_parallel_size": 2, "quantization": "fp8"}
    online = PlanSettings.from_engine_kwargs({**online_kwargs, "pipeline_parallel_size": 1}, "cuda")
    assert plan_memory(LLAMA_3_70B, online, H100_BYTES).stages[0].weight_breakdown == (
        fp8_stage.weight_breakdown
    )
    # The CPU engine dequantizes at load: the dtype's bytes, and a note that says so.
    cpu = PlanSettings(device="cpu", num_kv_blocks=64, max_model_len=512)
    cpu_plan = plan_memory(gptq, cpu)
    assert cpu_plan.stages[0].weight_bytes == plan_memory(LLAMA_3_70B, cpu).stages[0].weight_bytes
    assert any("dequantizes them once at load" in n for n in cpu_plan.notes)


def test_unknown_gpu_memory_skips_only_the_memory_checks() -> None:
    kwargs = {**LLAMA_70B_KWARGS, "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    plan = plan_memory(LLAMA_3_70B, PlanSettings.from_engine_kwargs(kwargs, "cuda"), None)
    assert plan.fits and plan.kv_tokens is None
    assert any("GPU memory unknown" in n for n in plan.notes)
    bad = {**LLAMA_3_70B, "architectures": ["GPT2LMHeadModel"]}
    refused = plan_memory(bad, PlanSettings.from_engine_kwargs(kwargs, "cuda"), None)
    assert not refused.fits and "GPT2LMHeadModel" in refused.problems[0]


def test_reserves_are_counted_on_cuda_only() -> None:
    hf = builtin_config("tiny-llama")
    gpu = plan_memory(hf, PlanSettings(tensor_parallel_size=2), H100_BYTES).stages[0]
    assert gpu.reserve_bytes >= CUDA_CONTEXT_BYTES
    cpu = plan_memory(hf, dataclasses.replace(PlanSettings(), device="cpu")).stages[0]
    assert cpu.reserve_bytes == 0


def test_the_plan_module_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, engine.worker.memory_plan; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "False", out.stderr[-2000:]


# ---- mixture of experts ---------------------------------------------------------------------

# Qwen/Qwen3-30B-A3B's config.json, the fields that size it (no weights needed).
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.mark.parametrize(
    "name", ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-gpt-oss"]
)
def test_moe_plan_counts_every_parameter_of_the_loaded_engine_model(name: str) -> None:
    from engine.worker.worker import Worker

    kwargs = {"max_model_len": 256, "max_num_seqs": 2, "dtype": "float32"}
    config = EngineConfig.from_kwargs(model=f"builtin:{name}", device="cpu", **kwargs)
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    model = worker.runner.model
    # On CPU the linear weights are packed into oneDNN's layout (``weight_shape`` stays).
    numel = sum(p.numel() for p in model.parameters()) + sum(
        math.prod(m.weight_shape)
        for m in model.modules()
        if getattr(m, "packed_weight", None) is not None and m.weight.numel() == 0
    )
    (stage,) = plan_memory(config.model.hf_config, PlanSettings(**kwargs, device="cpu")).stages
    assert stage.weight_bytes == 4 * numel == worker.parameter_bytes()
    # The experts are most of it: the dense-model arithmetic (one MLP of intermediate_size
    # per layer) would undercount.
    assert stage.weight_breakdown["experts"] > stage.weight_breakdown["attention"]


def test_qwen3_30b_a3b_per_gpu_bytes_under_tp_and_ep() -> None:
    """Worked by hand: 48 layers x 128 experts x 3 x 2048 x 768 bf16 = 57.98 GB of experts,
    a quarter per GPU at TP 4 (every expert, a quarter of its intermediate rows) and at EP 4
    (32 whole experts); the router 128 x 2048 replicated on every GPU either way."""
    expert = 3 * 2048 * 768 * 2
    plans = {
        ep: plan_memory(
            QWEN3_30B_A3B,
            PlanSettings(tensor_parallel_size=4, enable_expert_parallel=ep),
            H100_BYTES,
        )
        for ep in (False, True)
    }
    for plan in plans.values():
        (stage,) = plan.stages
        assert stage.weight_breakdown["experts"] == 48 * 32 * expert
        assert stage.weight_breakdown["router"] == 48 * 128 * 2048 * 2
        assert stage.weight_breakdown["mlp"] == stage.weight_breakdown["shared_expert"] == 0
        assert plan.fits
    whole = plan_memory(QWEN3_30B_A3B, PlanSettings(), H100_BYTES)
    params = whole.stages[0].weight_bytes // 2
    assert 30.4e9 < params < 30.6e9  # "30.5B" on the model card


def test_qwen3_30b_a3b_at_dp2_tp4_holds_an_eighth_of_the_experts_and_two_cores_of_kv() -> None:
    """DP 2 x TP 4: EP 8, so 16 whole experts per GPU (half of TP 4's 32); each core's TP
    group holds its own KV cache, so the replica holds twice the sequences of one core."""
    expert = 3 * 2048 * 768 * 2
    tp4 = PlanSettings(tensor_parallel_size=4, enable_expert_parallel=True)
    dp2 = dataclasses.replace(tp4, data_parallel_size=2)
    one, two = (plan_memory(QWEN3_30B_A3B, s, H100_BYTES) for s in (tp4, dp2))
    assert two.stages[0].weight_breakdown["experts"] == 48 * 16 * expert
    assert one.stages[0].weight_breakdown["experts"] == 48 * 32 * expert
    assert two.kv_blocks > one.kv_blocks  # less weight per GPU leaves more for the cache
    per_core = two.kv_tokens // two.max_model_len
    assert two.max_concurrent_sequences == 2 * per_core
    assert two.to_dict()["data_parallel_size"] == 2
    hf = {**QWEN3_30B_A3B, "num_experts": 102}  # divides by TP 2, not by DP 2 x TP 2
    refused = plan_memory(hf, dataclasses.replace(dp2, tensor_parallel_size=2))
    assert "(data_parallel_size x tensor_parallel_size), got 4" in refused.problems[-1]


def test_moe_experts_the_ep_size_does_not_divide_are_a_problem() -> None:
    hf = {**QWEN3_30B_A3B, "num_experts": 100}
    plan = plan_memory(hf, PlanSettings(tensor_parallel_size=8, enable_expert_parallel=True))
    assert plan.stages == () and not plan.fits
    assert "enable_expert_parallel: needs num_experts (100)" in plan.problems[-1]


def test_gpt_oss_window_layers_hold_only_their_window_in_the_plan() -> None:
    """gpt-oss-120b at 131072 tokens: 18 layers of window 128 and 18 of full attention. The
    sliding group needs 256 decoding sequences of 9 blocks, a 2048-token chunk and its null
    block; the rest of its share goes to the full group, which then holds about twice the
    max_model_len sequences that one pool for all layers would."""
    kwargs = {"dtype": "bfloat16", "max_model_len": 131072, "gpu_memory_utilization": 0.92}
    plan = plan_memory(GPT_OSS_120B, PlanSettings.from_engine_kwargs(kwargs, "cuda"), H100_BYTES)
    full, sliding = plan.kv_groups
    assert (full.sliding_window, sliding.sliding_window) == (None, 128)
    assert full.num_layers == sliding.num_layers == 18
    assert full.bytes_per_token == sliding.bytes_per_token == 18 * 2 * 8 * 64 * 2
    assert plan.kv_blocks is not None and full.blocks is not None
    assert sliding.blocks == 256 * 9 + 2048 // 16 + 1
    assert full.blocks == 2 * plan.kv_blocks - sliding.blocks
    one_pool = plan.kv_blocks * 16 // 131072
    assert plan.max_concurrent_sequences == full.blocks * 16 // 131072 >= 2 * one_pool - 1
    assert plan.kv_tokens == full.blocks * 16


def test_a_real_hybrid_engine_splits_its_kv_cache_as_the_plan_says() -> None:
    from engine import LLM

    kwargs = {"max_model_len": 512, "max_num_seqs": 4, "cpu_kv_cache_space": 0.001}
    llm = LLM("builtin:tiny-gemma3", device="cpu", **kwargs)
    hf = llm.llm_engine.config.model.hf_config
    plan = plan_memory(hf, PlanSettings.from_engine_kwargs(kwargs, "cpu"))
    layout = llm.llm_engine.block_manager.layout
    assert [g.sliding_window for g in plan.kv_groups] == [None, 40]
    assert layout.num_blocks == tuple(g.blocks for g in plan.kv_groups)
    assert layout.num_blocks[1] < layout.num_blocks[0]
