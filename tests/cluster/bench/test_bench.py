"""``cluster bench throughput`` as a smoke test: it runs every system on a tiny model and
writes complete JSON with positive figures (timings are measurements, never asserted)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.bench.model_shape import (
    DENSE_FAMILIES,
    FAMILIES,
    MOE_FAMILIES,
    ModelShape,
    shape_from_args,
)
from cluster.bench.throughput import SystemResult, _median, add_arguments, default_vllm_python

TINY_SHAPE = [
    "--hidden-size", "64", "--num-hidden-layers", "2", "--num-attention-heads", "4",
    "--num-key-value-heads", "2", "--intermediate-size", "128", "--vocab-size", "1024",
]  # fmt: skip


@pytest.mark.slow
def test_bench_throughput_writes_complete_json(tmp_path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "cluster.cli",
        "bench",
        "throughput",
        "--num-prompts",
        "3",
        "--input-len",
        "4:12",
        "--output-len",
        "2:4",
        "--hidden-size",
        "64",
        "--num-hidden-layers",
        "2",
        "--num-attention-heads",
        "4",
        "--num-key-value-heads",
        "2",
        "--intermediate-size",
        "128",
        "--vocab-size",
        "1024",
        "--hf-batch-size",
        "4",
        "--json",
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {
        "systems", "ratios", "roofline", "step_profile", "conditions", "rounds"
    }  # fmt: skip
    assert set(report["systems"]) == {"engine", "hf_static", "hf_cb"}
    rates = {"output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "wall_s"}
    for name, figures in report["systems"].items():
        # The engine also says what a token costs in its cache (HF's dynamic cache does not).
        assert set(figures) == rates | ({"kv_cache_bytes_per_token"} if name == "engine" else set())
        assert all(v > 0 for v in figures.values())
    assert set(report["ratios"]) == {"engine/hf_static", "engine/hf_cb"}
    assert report["roofline"]["gemm_flops_per_s"] > 0
    assert report["roofline"]["engine_fraction_of_gemm"] > 0
    assert report["step_profile"]["seconds"]["forward"] > 0
    assert report["conditions"]["workload"]["num_prompts"] == 3
    assert "ratio engine/hf_static" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "expected_config"),
    [
        ("qwen3", {"architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": False}),
        (
            "gemma2",
            {
                "architectures": ["Gemma2ForCausalLM"],
                "tie_word_embeddings": True,
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
                "query_pre_attn_scalar": 16,
            },
        ),
    ],
)
def test_bench_family_builds_that_architecture_for_engine_and_hf(
    tmp_path: Path, family: str, expected_config: dict[str, object]
) -> None:
    """``--family`` benchmarks a random checkpoint of that architecture at the ``--*-size``
    shape, cached under a dirname of its own: the engine generates every requested token on
    it, and HF loads it as that class with the tokenizer covering the vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, cache = tmp_path / "bench.json", tmp_path / "cache"
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "throughput", "--systems", "engine",
           "--family", family, "--num-prompts", "2", "--input-len", "4:8", "--output-len", "2:3",
           *TINY_SHAPE, "--json", str(out)]  # fmt: skip
    env = {**os.environ, "LLM_CLUSTER_CACHE_DIR": str(cache)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["conditions"]["model"]["family"] == family
    assert report["systems"]["engine"]["output_tokens_per_s"] > 0
    shape = ModelShape(64, 2, 4, 2, 128, 1024, family=family)
    model_dir = cache / "models" / shape.dirname
    assert model_dir.name.startswith(f"bench-{family}-h64-")
    config = json.loads((model_dir / "config.json").read_text())
    assert {k: config[k] for k in expected_config} == expected_config
    assert config["head_dim"] == 16 and config["num_key_value_heads"] == 2
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(hf).__name__ == expected_config["architectures"][0]
    assert len(AutoTokenizer.from_pretrained(model_dir)) == hf.config.vocab_size == 1024


def test_bench_llama_keeps_its_cache_dirname() -> None:
    """The default family is llama, whose cached checkpoints keep the name they had before
    ``--family``; every family's random model is one ``engine.builtin.tiny_models`` can build."""
    from engine.builtin.tiny_models import RANDOM_MODEL_FAMILIES

    assert ModelShape().dirname == "bench-llama-h768-l12-a12-kv4-i1536-v32000-t2"
    assert DENSE_FAMILIES == RANDOM_MODEL_FAMILIES
    assert FAMILIES == DENSE_FAMILIES + MOE_FAMILIES


def _shape(*argv: str) -> ModelShape:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return shape_from_args(parser.parse_args(list(argv)))


def test_bench_qwen3_moe_defaults_to_a_0_3b_model_with_16_experts_top_4() -> None:
    shape = _shape("--family", "qwen3-moe")
    assert (shape.hidden_size, shape.num_hidden_layers, shape.intermediate_size) == (768, 12, 512)
    assert (shape.num_experts, shape.num_experts_per_tok) == (16, 4)
    assert 0.28e9 < shape.total_params() < 0.32e9
    # Top-4 of 16: about as many parameters per token as the dense bench model.
    assert 0.7e8 < shape.linear_params_per_token() < 0.8e8
    assert shape.dirname == "bench-qwen3-moe-h768-l12-a12-kv4-i512-v32000-e16k4-t2"
    # The dense families keep their defaults and their options.
    assert _shape("--family", "qwen3") == ModelShape(family="qwen3")
    assert _shape("--hidden-size", "64") == ModelShape(hidden_size=64)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-experts", "8"], "only for an MoE --family"),
        (["--family", "qwen3-moe", "--num-experts-per-tok", "17"], "must be in [1, "),
        (["--family", "qwen3-moe", "--num-experts", "0"], "must be in [1, "),
    ],
)
def test_bench_expert_options_are_checked_by_name(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        _shape(*argv)


@pytest.mark.slow
def test_bench_qwen3_moe_runs_the_engine_on_its_random_checkpoint(tmp_path: Path) -> None:
    """The smallest ``--family qwen3-moe`` run: a 2-layer, 4-expert top-2 checkpoint that HF
    loads as ``Qwen3MoeForCausalLM`` and the engine generates every requested token on."""
    from transformers import AutoConfig

    out, cache = tmp_path / "bench.json", tmp_path / "cache"
    moe = ["--num-experts", "4", "--num-experts-per-tok", "2", "--intermediate-size", "32"]
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "throughput", "--systems", "engine",
           "--family", "qwen3-moe", "--num-prompts", "2", "--input-len", "4:8",
           "--output-len", "2:3", *TINY_SHAPE, *moe, "--json", str(out)]  # fmt: skip
    env = {**os.environ, "LLM_CLUSTER_CACHE_DIR": str(cache)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    model = report["conditions"]["model"]
    assert (model["family"], model["num_experts"], model["num_experts_per_tok"]) == (
        "qwen3-moe",
        4,
        2,
    )
    assert report["systems"]["engine"]["output_tokens_per_s"] > 0
    model_dir = cache / "models" / "bench-qwen3-moe-h64-l2-a4-kv2-i32-v1024-e4k2-t2"
    config = AutoConfig.from_pretrained(model_dir)
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        4,
        2,
        32,
    )
    assert config.mlp_only_layers == []


def test_bench_deepseek_v3_defaults_to_a_0_3b_latent_attention_model() -> None:
    """V3's heads at the bench width: 16 experts top-4 + 1 shared, layer 0 dense, its
    parameter count exactly what HF builds (meta device), V3's latent of 576 values per token
    and layer against 1536 for multi-head attention of the same width."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    shape = _shape("--family", "deepseek-v3")
    assert (shape.num_experts, shape.num_experts_per_tok, shape.num_key_value_heads) == (16, 4, 6)
    assert shape.kv_values_per_token() == 512 + 64
    assert ModelShape(num_key_value_heads=12).kv_values_per_token() == 2 * 768
    config = DeepseekV3Config(
        vocab_size=32000, hidden_size=768, intermediate_size=1536, moe_intermediate_size=512,
        num_hidden_layers=12, num_attention_heads=6, num_key_value_heads=6,
        n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=4,
        topk_group=2, first_k_dense_replace=1, tie_word_embeddings=False, **shape.mla_dims(),
    )  # fmt: skip
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    matmuls = sum(p.numel() for n, p in hf.named_parameters() if "norm" not in n)
    assert shape.total_params() == matmuls
    assert 0.28e9 < shape.total_params() < 0.32e9


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--family", "deepseek-v3", "--num-key-value-heads", "4"], "has no KV heads"),
        (["--family", "deepseek-v3", "--num-experts", "6"], "a multiple of 4"),
        (["--family", "deepseek-v3", "--num-experts-per-tok", "9"], "at most half"),
        (["--family", "deepseek-v3", "--hidden-size", "60"], "divisible by 4"),
    ],
)
def test_bench_deepseek_v3_options_are_checked_by_name(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        _shape(*argv)


@pytest.mark.slow
def test_bench_deepseek_v3_runs_the_engine_on_its_random_checkpoint(tmp_path: Path) -> None:
    """The smallest ``--family deepseek-v3`` run: a checkpoint HF loads as
    ``DeepseekV3ForCausalLM`` with a latent cache, and the engine generates every token."""
    from transformers import AutoConfig

    out, cache = tmp_path / "bench.json", tmp_path / "cache"
    shape = ["--hidden-size", "64", "--num-hidden-layers", "2", "--num-attention-heads", "4",
             "--intermediate-size", "32", "--vocab-size", "1024", "--num-experts", "8",
             "--num-experts-per-tok", "2"]  # fmt: skip
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "throughput", "--systems", "engine",
           "--family", "deepseek-v3", "--num-prompts", "2", "--input-len", "4:8",
           "--output-len", "2:3", *shape, "--json", str(out)]  # fmt: skip
    env = {**os.environ, "LLM_CLUSTER_CACHE_DIR": str(cache)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["conditions"]["model"]["family"] == "deepseek-v3"
    assert report["systems"]["engine"]["output_tokens_per_s"] > 0
    # Two layers of one fp32 latent: kv_lora_rank 64 (4 x head 16) + rope key 8.
    assert report["systems"]["engine"]["kv_cache_bytes_per_token"] == 2 * (64 + 8) * 4
    model_dir = cache / "models" / "bench-deepseek-v3-h64-l2-a4-kv4-i32-v1024-e8k2-t2"
    config = AutoConfig.from_pretrained(model_dir)
    assert config.architectures == ["DeepseekV3ForCausalLM"]
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.q_lora_rank) == (64, 8, 96)
    assert (config.n_routed_experts, config.first_k_dense_replace, config.intermediate_size) == (
        8,
        1,
        96,
    )


@pytest.mark.slow
def test_bench_gpt_oss_counts_what_hf_builds_and_runs_the_engine(tmp_path: Path) -> None:
    """``--family gpt-oss``: at the defaults its matmul parameters are exactly HF's (meta
    device; biases, sinks and norms aside); the smallest run writes a checkpoint HF reads as
    ``GptOssForCausalLM`` with gpt-oss's window and yarn, and the engine generates on it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GptOssConfig

    shape = _shape("--family", "gpt-oss")
    config = GptOssConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=512, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_local_experts=16,
        num_experts_per_tok=4, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    skip = ("norm", "bias", "sinks")
    matmuls = sum(p.numel() for n, p in hf.named_parameters() if not any(s in n for s in skip))
    assert shape.total_params() == matmuls
    out, cache = tmp_path / "bench.json", tmp_path / "cache"
    small = ["--hidden-size", "64", "--num-hidden-layers", "2", "--num-attention-heads", "4",
             "--num-key-value-heads", "2", "--intermediate-size", "32", "--vocab-size", "1024",
             "--num-experts", "8", "--num-experts-per-tok", "2"]  # fmt: skip
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "throughput", "--systems", "engine",
           "--family", "gpt-oss", "--num-prompts", "2", "--input-len", "4:8",
           "--output-len", "2:3", *small, "--json", str(out)]  # fmt: skip
    env = {**os.environ, "LLM_CLUSTER_CACHE_DIR": str(cache)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["systems"]["engine"]["output_tokens_per_s"] > 0
    loaded = AutoConfig.from_pretrained(
        cache / "models" / "bench-gpt-oss-h64-l2-a4-kv2-i32-v1024-e8k2-t2"
    )
    assert loaded.architectures == ["GptOssForCausalLM"]
    assert loaded.layer_types == ["sliding_attention", "full_attention"]
    assert (loaded.sliding_window, loaded.rope_parameters["rope_type"]) == (128, "yarn")


@pytest.mark.slow
def test_bench_serve_compare_writes_complete_json_and_plot(tmp_path) -> None:
    import yaml

    from tests.cluster.conftest import free_port

    config = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    config["http_options"]["port"] = free_port()
    config["grpc_options"]["port"] = free_port()
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config))
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    cmd = [
        sys.executable,
        "-m",
        "cluster.cli",
        "bench",
        "serve",
        "--compare",
        str(config_path),
        "--num-prompts",
        "6",
        "--input-len",
        "4:12",
        "--output-len",
        "3:8",
        "--request-rate",
        "20",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"in_process", "ray_serve"}
    for figures in report["results"].values():
        assert figures["completed"] == 6 and figures["failed"] == 0
        assert figures["output_token_throughput"] > 0
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(figures[metric]) == {"mean", "p50", "p90", "p99"}
            assert figures[metric]["p50"] > 0
    assert report["overhead"]["throughput_ratio_serve_vs_in_process"] > 0
    assert png.stat().st_size > 1000


@pytest.mark.slow
def test_bench_throughput_vllm_without_vllm_names_the_option(tmp_path) -> None:
    """An interpreter without vLLM is refused before anything runs, naming ``--vllm-python``."""
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "throughput", "--systems", "engine,vllm",
           "--vllm-python", sys.executable, *TINY_SHAPE]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "--vllm-python" in result.stderr and "cannot import vllm" in result.stderr
    assert "running engine" not in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    default_vllm_python() == sys.executable, reason="vLLM's CPU build (../shared/peers) not set up"
)
def test_bench_throughput_runs_vllm_in_its_peer_venv_in_rounds(tmp_path) -> None:
    """The real vLLM, in its own venv, on the engine's workload (one round, eager: vLLM takes
    ~35 s to start that way and ~70 s with torch.compile; rounds are ``_median``'s test)."""
    out = tmp_path / "bench.json"
    # head_dim 64: vLLM's CPU attention has no kernel for the smoke shape's 16.
    shape = [
        "--hidden-size",
        "128",
        "--num-hidden-layers",
        "2",
        "--num-attention-heads",
        "2",
        "--num-key-value-heads",
        "1",
        "--intermediate-size",
        "256",
        "--vocab-size",
        "1024",
    ]
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "throughput", "--systems", "engine,vllm",
           "--num-prompts", "4", "--input-len", "4:8", "--output-len", "4:6", "--enforce-eager",
           *shape, "--json", str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["systems"]) == {"engine", "vllm"}
    assert [len(v) for v in report["rounds"].values()] == [1, 1]
    assert all(v > 0 for v in report["rounds"]["vllm"])
    assert report["conditions"]["vllm"]["version"]
    assert "ratio engine/vllm" in result.stdout
    # Both caches hold K and V of one 64-wide KV head in fp32 on each of 2 layers.
    kv = {name: figures["kv_cache_bytes_per_token"] for name, figures in report["systems"].items()}
    assert kv == {"engine": 2 * 2 * 64 * 4, "vllm": 2 * 2 * 64 * 4}


def test_rounds_report_the_median_round() -> None:
    rounds = [SystemResult(w, 10, 20, 2) for w in (3.0, 1.0, 2.0, 5.0)]
    assert _median(rounds).wall_s == 2.0  # the lower middle of an even count
    assert _median(rounds[:3]).wall_s == 2.0
    assert _median(rounds[:1]).wall_s == 3.0
