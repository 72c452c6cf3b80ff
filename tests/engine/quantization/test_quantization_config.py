"""What the engine refuses about quantization, by name and before anything is placed; the
int4 packing against compressed-tensors' own packer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM
from engine.builtin.catalog import resolve_model_source
from engine.config import EngineConfig, check_engine_arg_ranges
from engine.errors import ConfigError
from engine.quantization.config import ActivationQuant, QuantScheme, parse_quantization
from engine.quantization.formats import pack_nibbles, unpack_ct_int4, unpack_ct_zero_points
from engine.quantization.kept import QuantizedWeight, kept_problem

_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}


def _ct(weights: dict[str, Any], acts: dict[str, Any] | None = None, **top: Any) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {
        "quant_method": "compressed-tensors",
        "format": top.pop("format", "float-quantized"),
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        **top,
    }


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True},
            "quantization_config: quant_method 'bitsandbytes' is not supported (supported: "
            "compressed-tensors, gptq, awq",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            "quantization_config.activation_scheme: 'static' is not supported (dynamic)",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 0]},
            "quantization_config.weight_block_size: [128, 0] is not supported",
        ),
        (
            _ct({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}),
            "config_groups.group_0.weights: 'int 8-bit' is not supported",
        ),
        (
            _ct({"num_bits": 2, "type": "int", "strategy": "group", "group_size": 128}),
            "config_groups.group_0.weights: 'int 2-bit' is not supported",
        ),
        (
            _ct(_FP8, {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}),
            "input_activations: \"strategy 'tensor', dynamic True\" is not supported",
        ),
        (
            _ct(
                {
                    "num_bits": 4,
                    "type": "int",
                    "strategy": "group",
                    "group_size": 128,
                    "actorder": "group",
                },
                format="pack-quantized",
            ),
            "weights.actorder: 'group' is not supported",
        ),
        (_ct(_FP8, format="marlin-24"), "format: 'marlin-24' is not supported"),
        (
            _ct(_FP8, kv_cache_scheme={"num_bits": 8, "type": "int", "strategy": "tensor"}),
            "quantization_config.kv_cache_scheme: ",
        ),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
            "quantization_config.desc_act: True is not supported",
        ),
        ({"quant_method": "gptq", "bits": 8}, "quantization_config.bits: 8 is not supported"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version: 'gemv'"),
        # Sizes that are not positive integers: named, not a ZeroDivisionError at load.
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "quantization_config.group_size: 0"),
        ({"quant_method": "awq", "bits": 4, "group_size": -1}, "config.group_size: -1"),
        ({"quant_method": "awq", "bits": 4, "q_group_size": 0}, "quantization_config.q_group_size"),
        (
            _ct({**_FP8, "strategy": "block", "block_structure": [0, 32]}),
            "weights.block_structure: 0 is not supported (a positive integer)",
        ),
        (
            _ct(_FP8, {"num_bits": 8, "type": "float", "strategy": "group", "dynamic": True}),
            "input_activations.group_size: None is not supported (a positive integer)",
        ),
    ],
)
def test_unsupported_quantization_is_refused_naming_it(quant: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_quantization({"quantization_config": quant})
    assert message in str(err.value)


def _with_quant(tmp_path: Path, quant: dict | None) -> str:
    model = tmp_path / "m"
    shutil.copytree(resolve_model_source("builtin:tiny-llama"), model)
    hf = json.loads((model / "config.json").read_text())
    if quant is not None:
        hf["quantization_config"] = quant
    (model / "config.json").write_text(json.dumps(hf))
    return str(model)


def test_an_fp8_kv_cache_scheme_is_accepted() -> None:
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    assert parse_quantization({"quantization_config": _ct(_FP8, kv_cache_scheme=kv)})


def test_refused_before_anything_is_placed(tmp_path: Path) -> None:
    path = _with_quant(tmp_path, {"quant_method": "bitsandbytes"})
    with pytest.raises(ConfigError, match="quant_method 'bitsandbytes'"):
        EngineConfig.from_kwargs(model=path)


def test_online_fp8_is_refused_for_a_quantized_checkpoint_and_other_methods(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"^quantization: must be one of None, 'fp8', got 'int8'"):
        check_engine_arg_ranges({"quantization": "int8"})
    path = _with_quant(tmp_path, _ct(_FP8))
    with pytest.raises(ConfigError, match=r"already quantized .*'compressed-tensors'"):
        EngineConfig.from_kwargs(model=path, quantization="fp8")


def test_act_order_g_idx_is_refused_at_load(tmp_path: Path) -> None:
    from tests.engine.quantization.quant_checkpoints import dense_model, write_gptq_awq

    path = tmp_path / "gptq"
    write_gptq_awq(dense_model(tmp_path, "llama"), path, "gptq")
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()  # groups out of column order
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj: g_idx: .*act-order"):
        LLM(str(path), num_kv_blocks=8)


def test_int4_packing_matches_compressed_tensors() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (24, 64), generator=g, dtype=torch.int8)
    packed = pack_to_int32(q, 4)
    assert torch.equal(unpack_ct_int4(packed, 64), q)
    assert torch.equal(pack_nibbles(q.to(torch.int32) + 8), packed)
    zp = torch.randint(-8, 8, (24, 2), generator=g, dtype=torch.int8)
    assert torch.equal(unpack_ct_zero_points(pack_to_int32(zp, 4, packed_dim=0), 24), zp)


def _int4_weight(n: int, k: int, group: int) -> QuantizedWeight:
    scheme = QuantScheme("int4", "group", "ct-pack-quantized", group_size=group, symmetric=False)
    packed = torch.zeros(n, k // 8, dtype=torch.int32)
    scale = torch.ones(n, k // group)
    zp = torch.zeros(n, k // group, dtype=torch.int8)
    return QuantizedWeight(scheme, packed, scale, zp, None, k, torch.device("cpu"))


def test_a_tp_size_that_cuts_a_group_is_refused_naming_it() -> None:
    w = _int4_weight(8, 384, 128)
    with pytest.raises(ValueError, match="would cut a quantization group of 128 input columns"):
        w[:, 192:384]
    assert w[:, 128:256].scale.shape == (8, 1) and w[:, 128:256].data.shape == (8, 16)


def test_fp8_block_slices_keep_whole_blocks() -> None:
    scheme = QuantScheme("fp8", "block", "ct-float-quantized", block=(128, 128))
    w = QuantizedWeight(
        scheme,
        torch.zeros(256, 256, dtype=torch.float8_e4m3fn),
        torch.arange(4.0).reshape(2, 2),
        None,
        None,
        256,
        torch.device("cpu"),
    )
    assert w[128:256].scale.tolist() == [[2.0, 3.0]]
    assert w[:, 0:128].scale.tolist() == [[0.0], [2.0]]
    with pytest.raises(ValueError, match="would cut an FP8 block of 128 output rows"):
        w[64:192]


def test_fp8_weight_only_cannot_stay_quantized() -> None:
    w8a16 = QuantScheme("fp8", "channel", "ct-float-quantized")
    assert "W8A16" in kept_problem(w8a16)
    dynamic = QuantScheme(
        "fp8", "channel", "ct-float-quantized", activations=ActivationQuant(dynamic=True)
    )
    assert kept_problem(dynamic) is None


def test_activation_quantization_outside_linear_layers_is_refused(tmp_path: Path) -> None:
    from tests.engine.quantization.quant_checkpoints import (
        CASES,
        dense_model,
        write_compressed_tensors,
    )

    scheme, fmt, _ = CASES["fp8-channel"]
    path = write_compressed_tensors(
        dense_model(tmp_path, "llama"), tmp_path / "q", scheme, fmt, ignore=()
    )
    with pytest.raises(
        ValueError, match=r"^lm_head: FP8 activation quantization on a ParallelLMHead"
    ):
        LLM(str(path), num_kv_blocks=8)


def test_a_group_that_names_a_module_wins_over_the_linear_target() -> None:
    int4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
    config = _ct(_FP8, {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True})
    config["config_groups"] = {
        "fp8": {**config["config_groups"]["group_0"]},
        "int4": {"targets": ["re:.*mlp\\.down_proj$"], "weights": int4, "format": "pack-quantized"},
    }
    quant = parse_quantization({"quantization_config": config})
    assert quant.scheme_for("model.layers.0.mlp.down_proj").kind == "int4"
    assert quant.scheme_for("model.layers.0.self_attn.q_proj").kind == "fp8"
    assert quant.scheme_for("lm_head") is None
