"""``cluster plan CONFIG``: configs/llama70b.yaml with its model_source pointed at a directory
holding Llama-3-70B's config.json (no weights): per-stage figures, JSON, refusals (exit 2 with
the reasons on stderr), the GPU memory override, and ``preflight``'s error."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.cli import main
from cluster.config import load_config
from cluster.ops.plan import PlanError, gpu_memory_gib_for, plan_deployment, preflight
from engine.errors import ConfigError
from tests.cluster.conftest import CONFIGS, load_yaml
from tests.engine.worker.test_memory_plan import (
    DEEPSEEK_V3,
    GLM_4_6,
    GPT_OSS_120B,
    KIMI_K2,
    LLAMA_3_70B,
    QWEN3_30B_A3B,
)

MODEL_ID = "meta-llama/Meta-Llama-3-70B-Instruct"
# Per GPU at TP 4 x PP 2: 41 and 39 layers of bf16 shards (the balanced default: the LM head is
# ~1.2 layers of work) plus a quarter of the embedding (stage 0) or of the LM head and the final
# norm (stage 1); see tests/engine/worker/test_memory_plan.py.
LAYER_BYTES = (20 * 128 * 8192 + 8192 * 2048 + 14336 * 8192 + 8192 * 7168 + 2 * 8192) * 2
TABLE_BYTES = 128256 // 4 * 8192 * 2


def llama70b_yaml(tmp_path: Path, hf: dict[str, Any] = LLAMA_3_70B, **engine_kwargs: Any) -> Path:
    """configs/llama70b.yaml, its checkpoint a tmp dir with the real config.json (``hf``:
    another model's, in the same deployment)."""
    model_dir = tmp_path / "Meta-Llama-3-70B-Instruct"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf))
    data = copy.deepcopy(load_yaml("llama70b.yaml"))
    model = data["models"][0]
    model["model_loading_config"]["model_source"] = str(model_dir)
    model["engine_kwargs"].update(engine_kwargs)
    path = tmp_path / "llama70b.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cluster_plan_prints_the_per_gpu_figures_of_each_stage_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(llama70b_yaml(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert f"{MODEL_ID}: fits" in out
    assert "TP 4 x PP 2 = 8 GPUs per replica" in out
    assert "GPU memory 79.19 GiB (accelerator_type H100), usable 71.27 GiB" in out
    assert "stage 0 (41 layers, 0-40) x4" in out and "stage 1 (39 layers, 41-79) x4" in out
    assert f"{(41 * LAYER_BYTES + TABLE_BYTES) / 2**30:.2f} GiB" in out  # 16.83 GiB
    assert "sequence(s) of max_model_len 8192 at once" in out
    assert "estimates" in out


def test_cluster_plan_sizes_data_parallel_cores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3-30B-A3B at DP 2 x TP 4: eight GPUs a replica, the experts split over all eight,
    each core's KV cache its own."""
    kwargs = {"data_parallel_size": 2, "enable_expert_parallel": True, "max_model_len": 32768}
    path = llama70b_yaml(tmp_path, QWEN3_30B_A3B, pipeline_parallel_size=1, **kwargs)
    assert main(["plan", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["models"][0]["plan"]
    assert plan["data_parallel_size"] == 2
    assert plan["stages"][0]["weight_breakdown"]["experts"] == 48 * 16 * 3 * 2048 * 768 * 2
    assert plan["max_concurrent_sequences"] == 2 * (plan["kv_tokens"] // 32768)
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "DP 2 x TP 4 x PP 1 = 8 GPUs per replica" in out
    assert "KV cache per engine core (2 per replica, each on its own TP group)" in out


def test_cluster_plan_shows_the_kv_store_and_how_many_blocks_it_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Llama-3-70B at TP 4 x PP 2 with a 64 GiB store: a block is K and V of all 80 layers over
    the 8 KV heads (1 KiB per token per layer per GPU, x TP 4), 16 tokens."""
    kv = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {
            "shared_storage_path": "/mnt/kv",
            "max_storage_bytes": 64 << 30,
        },
    }
    path = llama70b_yaml(tmp_path, kv_transfer_config=kv)
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    block = 80 * 1024 * 4 * 16  # 5 MiB
    held = (64 << 30) // block
    assert (
        f"KV store (SharedStorageConnector, kv_both): /mnt/kv, up to 64.00 GiB, shared by the "
        f"node's replicas: {held:,} blocks ({held * 16:,} prompt tokens) of 5.0 MiB"
    ) in out
    assert main(["plan", str(path), "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["models"][0]
    assert model["kv_store"]["kv_connector_extra_config"]["max_storage_bytes"] == 64 << 30


def test_plan_shows_nixl_transfers_block_size_and_how_long_unread_blocks_are_held(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"abort_request_timeout_s": 120}}  # fmt: skip
    assert main(["plan", str(llama70b_yaml(tmp_path, kv_transfer_config=kv))]) == 0
    assert (
        "KV transfer (NixlConnector, kv_producer): blocks of 5.0 MiB read from the prefill "
        "engine's KV cache with NIXL; unread ones held at most 120 s"
    ) in capsys.readouterr().out


def test_cluster_plan_json_carries_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(llama70b_yaml(tmp_path)), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True
    (model,) = data["models"]
    assert model["model_id"] == MODEL_ID and model["gpu_memory_gib"] == 79.19
    plan = model["plan"]
    first, last = plan["stages"]
    assert first["weight_bytes"] == 41 * LAYER_BYTES + TABLE_BYTES
    assert last["weight_bytes"] == 39 * LAYER_BYTES + TABLE_BYTES + 8192 * 2
    assert first["kv_bytes_per_token"] == 41 * 1024
    assert plan["kv_tokens"] == plan["kv_blocks"] * 16 > 1_000_000
    assert plan["max_concurrent_sequences"] == plan["kv_tokens"] // 8192


def test_llama70b_on_one_h100_is_refused_with_the_numbers_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = llama70b_yaml(tmp_path, tensor_parallel_size=1, pipeline_parallel_size=1)
    assert main(["plan", str(path)]) == 2
    captured = capsys.readouterr()
    assert f"{MODEL_ID}: REFUSED" in captured.out
    assert (
        f"refused: {MODEL_ID}: weights 131.42 GiB + buffers 0.01 GiB per GPU on pipeline "
        "stage 0 (TP 1 x PP 1) exceed a GPU's usable 71.27 GiB (79.19 GiB x "
        "gpu_memory_utilization 0.9)"
    ) in captured.err


def test_gpu_memory_gib_overrides_the_accelerator_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(llama70b_yaml(tmp_path))
    assert main(["plan", path, "--gpu-memory-gib", "16"]) == 2
    captured = capsys.readouterr()
    assert "GPU memory 16.00 GiB (--gpu-memory-gib)" in captured.out
    assert "exceed a GPU's usable 14.40 GiB (16.00 GiB x" in captured.err


def test_a_kv_cache_shorter_than_max_model_len_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 21.2 GiB GPUs: 19.08 GiB usable; the first stage's weights (16.83 GiB, 41 layers), its
    # step (~0.7 GiB) and the reserves (1.5 GiB) leave room for 1,088 tokens of 41 KiB, not one
    # of 8,192.
    path = str(llama70b_yaml(tmp_path))
    assert main(["plan", path, "--gpu-memory-gib", "21.2"]) == 2
    err = capsys.readouterr().err
    assert "the KV cache holds 1088 tokens per replica (pipeline stage 0: 41 layers x 41 KiB" in err
    assert "fewer than one max_model_len 8192 sequence needs; lower max_model_len" in err


def test_an_unknown_accelerator_skips_only_the_memory_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = yaml.safe_load(llama70b_yaml(tmp_path).read_text())
    data["models"][0]["accelerator_type"] = "TPU-V4"
    path = tmp_path / "tpu.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "GPU memory unknown" in out and "'TPU-V4' has no known memory size" in out
    assert "KV cache: unknown without the GPU's memory" in out


def test_a_quantized_checkpoint_is_sized_and_an_unsupported_one_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = llama70b_yaml(tmp_path)
    model_dir = tmp_path / "Meta-Llama-3-70B-Instruct"
    fp8_args = {"num_bits": 8, "type": "float", "symmetric": True}
    group = {
        "targets": ["Linear"],
        "weights": {**fp8_args, "strategy": "channel"},
        "input_activations": {**fp8_args, "strategy": "token", "dynamic": True},
    }
    fp8 = {
        **LLAMA_3_70B,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
        },
    }
    (model_dir / "config.json").write_text(json.dumps(fp8))
    assert main(["plan", str(path), "--json"]) == 0
    stage = json.loads(capsys.readouterr().out)["models"][0]["plan"]["stages"][0]
    # Kept as FP8 on the GPUs: a byte per weight of gate, up and down ([7168, 8192] per rank
    # each) and a float32 scale per output row (gate_up's 2 x 7168, down's 8192).
    expected = 41 * 3 * 7168 * 8192 + 41 * (2 * 7168 + 8192) * 4
    assert stage["weight_breakdown"]["mlp"] == expected
    bnb = {**LLAMA_3_70B, "quantization_config": {"quant_method": "bitsandbytes"}}
    (model_dir / "config.json").write_text(json.dumps(bnb))
    assert main(["plan", str(path), "--json"]) == 2
    assert "quantization_config: quant_method 'bitsandbytes' is not supported" in (
        capsys.readouterr().err
    )


def test_a_checkpoint_not_on_this_machine_is_skipped_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    plan = plan_deployment(load_config(load_yaml("llama70b.yaml")))
    (model,) = plan.models
    assert plan.fits and model.plan is None
    assert "is not on this machine" in (model.skipped or "")
    assert f"--hf-config {MODEL_ID}=PATH/config.json" in (model.skipped or "")
    assert main(["plan", "configs/llama70b.yaml"]) == 0
    assert capsys.readouterr().out.startswith(f"{MODEL_ID}: not planned\n")


def test_hf_config_plans_a_checkpoint_that_is_not_on_this_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/llama70b.yaml as it is (its /models path absent here), planned from a
    config.json given on the command line, with or without the model id, file or directory;
    the figures are those of the same config.json at model_source."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    (tmp_path / "l70").mkdir()
    (tmp_path / "l70" / "config.json").write_text(json.dumps(LLAMA_3_70B))
    assert main(["plan", str(llama70b_yaml(tmp_path)), "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)["models"][0]["plan"]
    for value in (str(tmp_path / "l70"), f"{MODEL_ID}={tmp_path / 'l70' / 'config.json'}"):
        assert main(["plan", "configs/llama70b.yaml", "--hf-config", value, "--json"]) == 0
        model = json.loads(capsys.readouterr().out)["models"][0]
        assert model["hf_config_from"] == "--hf-config"
        assert model["plan"] == expected
    assert main(["plan", "configs/llama70b.yaml", "--hf-config", f"other={tmp_path}/l70"]) == 2
    assert "hf_config: no model 'other' in the config" in capsys.readouterr().err
    assert main(["plan", "configs/llama70b.yaml", "--hf-config", str(tmp_path)]) == 2
    assert "error: --hf-config: " in capsys.readouterr().err


def test_a_model_id_in_the_local_hugging_face_cache_is_planned_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only read: the snapshot refs/main names, as the hub cache lays it out."""
    repo = tmp_path / "hub" / ("models--" + MODEL_ID.replace("/", "--"))
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(LLAMA_3_70B))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert main(["plan", "configs/llama70b.yaml"]) == 0
    out = capsys.readouterr().out
    assert f"{MODEL_ID}: fits" in out
    assert f"config.json from {repo / 'snapshots' / 'abc123' / 'config.json'}" in out
    assert "stage 0 (41 layers, 0-40) x4" in out


def test_preflight_raises_a_config_error_naming_the_model_and_every_problem(
    tmp_path: Path,
) -> None:
    path = llama70b_yaml(tmp_path, tensor_parallel_size=1, pipeline_parallel_size=1)
    with pytest.raises(PlanError) as info:
        preflight(load_config(path))
    assert isinstance(info.value, ConfigError)
    assert list(info.value.problems) == [MODEL_ID]
    assert f"model {MODEL_ID!r}: weights 131.42 GiB" in str(info.value)
    assert preflight(load_config(llama70b_yaml(tmp_path))).fits


def test_accelerator_names_are_rays() -> None:
    from ray.util.accelerators import accelerators

    from cluster.ops.plan import GPU_MEMORY_GIB

    names = {v for k, v in vars(accelerators).items() if k.startswith("NVIDIA_")}
    assert set(GPU_MEMORY_GIB) <= names
    assert gpu_memory_gib_for("h100") == 79.19 and gpu_memory_gib_for("Z9000") is None


@pytest.mark.parametrize("command", ["deploy", "serve"])
def test_cluster_deploy_and_serve_refuse_before_touching_ray(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    from cluster.ops import deploy

    def no_ray(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray was reached before the plan refused")

    monkeypatch.setenv("LLM_CLUSTER_API_KEYS", "sk-test")
    monkeypatch.setattr(deploy, "connect", no_ray)
    monkeypatch.setattr(deploy, "direct_ingress", no_ray)
    path = llama70b_yaml(tmp_path, tensor_parallel_size=1, pipeline_parallel_size=1)
    with pytest.raises(SystemExit) as info:
        main([command, str(path)])
    assert info.value.code == 2
    assert f"refused: {MODEL_ID}: weights 131.42 GiB" in capsys.readouterr().err


# ---- the DeepSeek-V3 and Kimi K2 configs, planned from their published config.json ----------


@pytest.mark.parametrize(
    ("config", "hf", "stages"),
    [("deepseek-v3.yaml", DEEPSEEK_V3, 2), ("kimi-k2.yaml", KIMI_K2, 3)],
)
def test_the_shipped_deepseek_configs_plan_as_fitting_their_h200_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str, hf: dict, stages: int
) -> None:
    """``cluster plan configs/<config> --hf-config config.json``: block-FP8 linear layers, bf16
    experts (dequantized at load), 576 cached values per token and layer on every GPU of a
    stage; each stage fits an H200 with a cache of more than a million tokens."""
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert main(["plan", str(CONFIGS / config), "--hf-config", str(tmp_path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["models"][0]["plan"]
    assert plan["fits"] and len(plan["stages"]) == stages
    layers = [s["end_layer"] - s["first_layer"] for s in plan["stages"]]
    assert sum(layers) == 61
    for stage, count in zip(plan["stages"], layers):
        assert stage["kv_bytes_per_token"] == count * 576 * 2
        assert stage["weight_bytes"] < 100 * 2**30
    assert plan["kv_tokens"] > 1_000_000


def test_kimi_k2_on_two_h200_nodes_plans_the_tight_cache_its_config_warns_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K2))
    data = copy.deepcopy(load_yaml("kimi-k2.yaml"))
    data["models"][0]["engine_kwargs"]["pipeline_parallel_size"] = 2
    path = tmp_path / "kimi-k2.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", str(path), "--hf-config", str(tmp_path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["models"][0]["plan"]
    assert all(s["weight_bytes"] > 115 * 2**30 for s in plan["stages"])
    assert plan["kv_tokens"] < 200_000


def test_glm_4_6_plans_as_fitting_one_h200_node_and_two_h100_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/glm-4.6.yaml: bfloat16 on 8 H200 at TP 8 (~82 GiB of weights per GPU, one KV
    head each: 92 x 2 x 128 x 2 B per token); on H100 nodes the weights need PP 2, as the
    config's comment says."""
    (tmp_path / "config.json").write_text(json.dumps(GLM_4_6))

    def plan(data: dict[str, Any]) -> dict[str, Any]:
        path = tmp_path / "glm.yaml"
        path.write_text(yaml.safe_dump(data))
        main(["plan", str(path), "--hf-config", str(tmp_path), "--json"])
        return json.loads(capsys.readouterr().out)["models"][0]["plan"]

    data = load_yaml("glm-4.6.yaml")
    h200 = plan(data)
    assert h200["fits"] and len(h200["stages"]) == 1
    (stage,) = h200["stages"]
    assert stage["kv_bytes_per_token"] == 92 * 2 * 128 * 2
    assert 80 * 2**30 < stage["weight_bytes"] < 85 * 2**30
    assert h200["kv_tokens"] > 900_000
    data["models"][0]["accelerator_type"] = "H100"
    assert not plan(copy.deepcopy(data))["fits"]
    data["models"][0]["engine_kwargs"]["pipeline_parallel_size"] = 2
    assert plan(data)["fits"]


def test_gpt_oss_120b_plans_as_fitting_one_h100_with_its_experts_in_mxfp4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/gpt-oss-120b.yaml: one H100, the experts kept MXFP4 (~60.8 GiB of weights per
    GPU) and a cache past one 131072-token sequence (72 KiB per token)."""
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_120B))
    assert main(["plan", str(CONFIGS / "gpt-oss-120b.yaml"), "--hf-config", str(tmp_path),
                 "--json"]) == 0  # fmt: skip
    plan = json.loads(capsys.readouterr().out)["models"][0]["plan"]
    assert plan["fits"] and plan["tensor_parallel_size"] == 1
    (stage,) = plan["stages"]
    assert 60 * 2**30 < stage["weight_bytes"] < 61 * 2**30
    assert stage["kv_bytes_per_token"] == 36 * 2 * 8 * 64 * 2
    assert plan["max_model_len"] == 131072 < plan["kv_tokens"]


def test_cluster_plan_shows_a_replica_on_a_fraction_of_a_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Llama-3-70B's shape is far too big for half an H100; the plan shows the share and sizes
    # the replica within its 0.45 utilization (refused: the weights exceed it).
    path = llama70b_yaml(
        tmp_path, tensor_parallel_size=1, pipeline_parallel_size=1, gpu_memory_utilization=0.45
    )
    data = yaml.safe_load(path.read_text())
    data["models"][0]["placement_group_config"] = {"bundles": [{"GPU": 0.49}]}
    data["models"][0]["deployment_config"] = {"num_replicas": 2}
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", str(path)]) == 2
    captured = capsys.readouterr()
    assert (
        "  0.49 of a GPU per replica (placement_group_config.bundles): replicas share a GPU "
        "while their shares sum to at most 1 (2 of these), each within its "
        "gpu_memory_utilization of the memory"
    ) in captured.out
    assert "usable 35.64 GiB at gpu_memory_utilization 0.45" in captured.out
    assert "exceed a GPU's usable 35.64 GiB (79.19 GiB x gpu_memory_utilization 0.45)" in (
        captured.err
    )
    assert main(["plan", str(path), "--json"]) == 2
    (model,) = json.loads(capsys.readouterr().out)["models"]
    assert model["device_share"] == 0.49


def test_cluster_plan_still_plans_a_share_whose_bundles_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = llama70b_yaml(tmp_path, tensor_parallel_size=1, pipeline_parallel_size=1)
    data = yaml.safe_load(path.read_text())
    data["models"][0]["placement_group_config"] = {"bundles": [{"GPU": 0.49}, {"GPU": "x"}]}
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", str(path)]) == 2
    captured = capsys.readouterr()
    assert "0.49 of a GPU per replica" in captured.out
    assert "config error: models[0].placement_group_config.bundles: must list 1 bundle" in (
        captured.err
    )


def llama70b_pd_yaml(tmp_path: Path, **prefill_kwargs: Any) -> Path:
    """configs/llama70b.yaml disaggregated: ``prefill_kwargs`` over the model's engine_kwargs
    in the prefill pool, the decode pool as the model."""
    path = llama70b_yaml(tmp_path)
    data = yaml.safe_load(path.read_text())
    model = data["models"][0]
    del model["deployment_config"]  # each pool has its own
    model["disaggregation"] = {"prefill": {"engine_kwargs": prefill_kwargs}, "decode": {}}
    path.write_text(yaml.safe_dump(data))
    return path


def test_cluster_plan_plans_each_pool_of_a_disaggregated_model_with_its_own_kwargs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The prefill pool's gpu_memory_utilization 0.2 (over the model's 0.9) leaves a GPU
    15.84 GiB, less than its stage's 16.83 GiB of weights: that pool is refused, exit 2."""
    path = llama70b_pd_yaml(tmp_path, gpu_memory_utilization=0.2)
    assert main(["plan", str(path)]) == 2
    captured = capsys.readouterr()
    assert f"{MODEL_ID} (prefill): REFUSED" in captured.out
    assert f"{MODEL_ID} (decode): fits" in captured.out
    assert "usable 15.84 GiB at gpu_memory_utilization 0.2" in captured.out
    assert "KV store (SharedStorageConnector, kv_producer)" in captured.out
    assert f"refused: {MODEL_ID} (prefill): weights 16.83 GiB" in captured.err
    assert f"{MODEL_ID} (decode)" not in captured.err
    assert main(["plan", str(path), "--json"]) == 2
    models = json.loads(capsys.readouterr().out)["models"]
    assert [(m["role"], m["fits"]) for m in models] == [("prefill", False), ("decode", True)]


def test_preflight_refuses_a_disaggregated_model_whose_prefill_pool_cannot_fit(
    tmp_path: Path,
) -> None:
    with pytest.raises(PlanError) as info:
        preflight(load_config(llama70b_pd_yaml(tmp_path, gpu_memory_utilization=0.2)))
    assert list(info.value.problems) == [f"{MODEL_ID} (prefill)"]
    assert preflight(load_config(llama70b_pd_yaml(tmp_path, max_num_seqs=8))).fits
