"""MXFP4 checkpoints (gpt-oss's experts as ``_blocks`` / ``_scales``): dequantized at load (the
torch kernels) or kept MXFP4 (the Triton kernels, here through the interpreter), greedy
decoding equals HF transformers' ``Mxfp4Config(dequantize=True)`` in float32; kept, a TP or EP
rank holds its part of the blocks and scales and the ranks' partial sums make the dequantized
layer; the pairs are found across shard files in either order; a malformed pair, an MXFP4
tensor outside the stacked experts, and a family without stacked experts are refused by
name."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, Mxfp4Config

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_moe_models import GPT_OSS_MXFP4_CONFIG, materialize_tiny_gpt_oss_mxfp4
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.models.gpt_oss import GptOssExperts
from engine.quantization.config import parse_quantization
from engine.quantization.mxfp4 import DequantizedExperts, mxfp4_weights
from engine.worker import model_loader
from engine.worker.model_loader import checkpoint_headers, load_model
from llm_kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from parallel.state import GroupCoordinator, ParallelContext
from tests.engine.models.test_correctness import _hf_greedy

DOWN = "model.layers.2.mlp.experts.down_proj"


def _copy(tmp_path: Path) -> Path:
    path = tmp_path / "gpt-oss-mxfp4"
    shutil.copytree(materialize_tiny_gpt_oss_mxfp4(), path)
    return path


def _load(path: Path, dtype: str = "float32") -> nn.Module:
    config = EngineConfig.from_kwargs(model=str(path), dtype=dtype, attention_backend="torch")
    return load_model(config, ParallelContext(), torch.device("cpu"))


@pytest.fixture
def plain_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded weights left plain, to be read: packing them for oneDNN at load releases them."""
    monkeypatch.setattr(model_loader, "pack_linear_weights", lambda model: 0)
    monkeypatch.setattr(model_loader, "pack_expert_weights", lambda model: 0)


def _headers(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (h["dtype"], tuple(h["shape"])) for n, h in checkpoint_headers(path).items()}


def _checkpoint(path: Path) -> frozenset[str]:
    hf = json.loads((path / "config.json").read_text())
    return mxfp4_weights(hf, _headers(path))


# Past the sliding window (8); the longest one chunked over several steps.
PROMPTS = [[random.Random(5).randrange(5, 1024) for _ in range(n)] for n in (3, 30)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf_greedy() -> list[list[int]]:
    hf_model = AutoModelForCausalLM.from_pretrained(
        materialize_tiny_gpt_oss_mxfp4(),
        dtype=torch.float32,
        quantization_config=Mxfp4Config(dequantize=True),
    ).eval()
    with torch.no_grad():
        return [_hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_greedy_equals_hf_dequantized_in_float32(hf_greedy: list[list[int]], backend: str) -> None:
    """torch: the experts dequantized at load; triton: kept MXFP4, the fused kernel's."""
    path = str(materialize_tiny_gpt_oss_mxfp4())
    llm = LLM(path, dtype="float32", attention_backend=backend, max_num_batched_tokens=16,
              num_kv_blocks=64)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy


def _experts(backend: str, ctx: ParallelContext) -> GptOssExperts:
    config = EngineConfig.from_kwargs(
        model=str(materialize_tiny_gpt_oss_mxfp4()), dtype="float32", attention_backend=backend
    )
    experts = load_model(config, ctx, torch.device("cpu")).model.layers["1"].mlp.experts
    assert experts.mxfp4 == (backend == "triton")
    return experts


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_kept_mxfp4_ranks_sum_to_the_dequantized_layer(expert_parallel: bool) -> None:
    """TP 2 cuts the intermediate dim (32) in halves, so rank 1's down_proj inputs start 16
    values into their group; EP 2 gives each rank four whole experts."""
    whole = _experts("torch", ParallelContext())
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(20, 64, generator=g)
    values, ids = torch.topk(torch.randn(20, 8, generator=g), 2, dim=-1)
    weights = values.softmax(dim=-1)
    total = torch.zeros(20, 64)
    for rank in range(2):
        tp = GroupCoordinator(rank=rank, size=2, ranks=(0, 1))
        part = _experts("triton", ParallelContext(tp=tp, expert_parallel=expert_parallel))
        held = 4 if expert_parallel else 8
        assert part.gate_up_proj_blocks.shape == (held, 64 if expert_parallel else 32, 2, 16)
        with torch.no_grad():
            total += part(x, ids, weights)
    with torch.no_grad():
        torch.testing.assert_close(total, whole(x, ids, weights), rtol=1e-5, atol=1e-5)


def test_kept_mxfp4_experts_under_data_parallel_ep_are_refused_by_name() -> None:
    """Kept MXFP4 experts compute through the fused kernel only, which has no token exchange:
    data parallelism is refused by the engine config before anything is placed, and by the
    layer itself if built so. Dequantized (the torch kernels) they are served."""
    model = str(materialize_tiny_gpt_oss_mxfp4())
    dp = {"data_parallel_size": 2, "enable_expert_parallel": True}
    with pytest.raises(ConfigError, match=r"^data_parallel_size: > 1 does not cover MXFP4"):
        EngineConfig.from_kwargs(model=model, attention_backend="triton", **dp)
    EngineConfig.from_kwargs(model=model, attention_backend="torch", **dp)
    ep = GroupCoordinator(rank=1, size=2, ranks=(0, 1))
    with pytest.raises(ValueError, match=r"MXFP4 experts kept quantized .* no token exchange"):
        _experts("triton", ParallelContext(expert_parallel=True, ep=ep))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("plain_weights")
def test_experts_hold_transformers_dequantized_weights_exactly(dtype: torch.dtype) -> None:
    path = materialize_tiny_gpt_oss_mxfp4()
    hf_model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, quantization_config=Mxfp4Config(dequantize=True)
    )
    ours = _load(path, str(dtype).removeprefix("torch.")).model.layers["2"].mlp.experts
    theirs = hf_model.model.layers[2].mlp.experts
    # Ours: [E, 2I, H] as [gate | up] rows; HF's: [E, H, 2I] with gate and up interleaved.
    gate_up = theirs.gate_up_proj.data
    want = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
    assert ours.gate_up_proj.dtype == dtype
    assert torch.equal(ours.gate_up_proj, want)
    assert torch.equal(ours.down_proj, theirs.down_proj.data.transpose(1, 2))


def _split_shards(path: Path, first: str) -> None:
    """Rewrite ``path``'s one safetensors file as two shards: every ``_<first>`` tensor (with
    the dense ones) in the first, the partners in the second."""
    state = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    second = "scales" if first == "blocks" else "blocks"
    later = {n: t for n, t in state.items() if n.endswith(f"_{second}")}
    earlier = {n: t for n, t in state.items() if n not in later}
    save_file(earlier, str(path / "model-00001-of-00002.safetensors"))
    save_file(later, str(path / "model-00002-of-00002.safetensors"))


@pytest.mark.parametrize("first", ["blocks", "scales"])
@pytest.mark.usefixtures("plain_weights")
def test_pairs_are_found_across_shard_files_in_either_order(tmp_path: Path, first: str) -> None:
    whole = _load(materialize_tiny_gpt_oss_mxfp4()).state_dict()
    path = _copy(tmp_path)
    _split_shards(path, first)
    sharded = _load(path).state_dict()
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)


def test_scales_of_the_wrong_shape_are_refused_from_the_headers_naming_both(
    tmp_path: Path,
) -> None:
    path = _copy(tmp_path)
    state = load_file(str(path / "model.safetensors"))
    state[f"{DOWN}_scales"] = state[f"{DOWN}_scales"][:, :32].contiguous()
    save_file(state, str(path / "model.safetensors"))
    message = (
        rf"{DOWN}_scales: shape \[8, 32, 1\] does not match {DOWN}_blocks \[8, 64, 1, 16\] "
        r"\(expected \[8, 64, 1\]\)"
    )
    with pytest.raises(ValueError, match=message):
        _checkpoint(path)  # from the safetensors headers, before the model is built
    with pytest.raises(ValueError, match=message):
        _load(path)


def test_blocks_for_another_input_size_are_refused_naming_it(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    state = load_file(str(path / "model.safetensors"))
    for part in ("blocks", "scales"):
        name = f"{DOWN}_{part}"
        state[name] = torch.cat([state[name], state[name]], dim=2).contiguous()
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{DOWN}_blocks: shape \[8, 64, 2, 16\] != expected "):
        _checkpoint(path)


def test_mxfp4_outside_the_stacked_experts_is_refused(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    state[f"{name}_blocks"], state[f"{name}_scales"] = quantize_mxfp4(state.pop(name))
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"'{name}_blocks': MXFP4 is read only for stacked"):
        _checkpoint(path)


def test_blocks_without_scales_are_refused(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    state = load_file(str(path / "model.safetensors"))
    del state[f"{DOWN}_scales"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"'{DOWN}_blocks' has no '{DOWN}_scales'"):
        _checkpoint(path)


def test_mxfp4_is_refused_for_a_family_without_stacked_experts(tmp_path: Path) -> None:
    hf = {"architectures": ["MixtralForCausalLM"], "quantization_config": GPT_OSS_MXFP4_CONFIG}
    with pytest.raises(ConfigError, match=r"'mxfp4' is served for GptOssForCausalLM .* not "
                       r"'MixtralForCausalLM'"):  # fmt: skip
        parse_quantization(hf)
    model = tmp_path / "mixtral"
    shutil.copytree(resolve_model_source("builtin:tiny-mixtral"), model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = GPT_OSS_MXFP4_CONFIG
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="'mxfp4' is served for"):
        EngineConfig.from_kwargs(model=str(model))


def test_an_unknown_mxfp4_field_is_refused_naming_it() -> None:
    hf = {
        "architectures": ["GptOssForCausalLM"],
        "quantization_config": {"quant_method": "mxfp4", "group_size": 64},
    }
    with pytest.raises(ConfigError, match=r"quantization_config.group_size: 64 is not supported"):
        parse_quantization(hf)


def test_indexing_dequantizes_only_the_selected_part_exactly() -> None:
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (4, 6, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (4, 6, 3), dtype=torch.uint8, generator=g)
    view = DequantizedExperts(blocks, scales, torch.bfloat16)
    dense = dequantize_mxfp4(blocks, scales, torch.bfloat16).transpose(1, 2)  # [E, in, out]
    assert view.shape == dense.shape == (4, 96, 6)
    assert torch.equal(view[:], dense)
    assert torch.equal(view[1:3, :, 2:4], dense[1:3, :, 2:4])  # a TP rank's gate/up columns
    assert torch.equal(view[1:3, 20:70], dense[1:3, 20:70])  # down rows that cut groups
