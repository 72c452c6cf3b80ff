"""config.json checks made before anything is placed: what the engine cannot serve exactly is
refused with the field and its value, and every supported architecture has a model class."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine import LLM
from engine.builtin.catalog import resolve_model_source
from engine.errors import ConfigError
from engine.hf_config import (
    FULL,
    SLIDING,
    SUPPORTED_ARCHITECTURES,
    check_hf_config,
    layer_types,
    sliding_window,
)
from engine.models import MODEL_REGISTRY


def _config(name: str = "tiny-llama") -> dict[str, Any]:
    return json.loads((resolve_model_source(f"builtin:{name}") / "config.json").read_text())


def test_every_supported_architecture_has_a_model_class() -> None:
    assert sorted(SUPPORTED_ARCHITECTURES) == sorted(MODEL_REGISTRY)


@pytest.mark.parametrize(
    "name",
    ["tiny-llama", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-phi3", "tiny-deepseek-v3"],
)
def test_built_in_configs_pass(name: str) -> None:
    check_hf_config(_config(name))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["MambaForCausalLM"]}, "architectures: 'MambaForCausalLM'"),
        (
            {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}},
            "quantization_config.weight_block_size: None is not supported",
        ),
        (
            {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
            "quantization_config: quant_method 'bitsandbytes' is not supported",
        ),
        (
            {"quantization_config": {"quant_method": "compressed-tensors"}},
            "quantization_config.config_groups: must be a non-empty mapping",
        ),
        ({"hidden_act": "relu2"}, "hidden_act: 'relu2'"),
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_type: 'mrope'"),
        ({"sliding_window": 0}, "sliding_window: must be a positive integer"),
        ({"layer_types": ["full_attention"]}, "layer_types: has 1 entries"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping: LlamaForCausalLM"),
        ({"num_attention_heads": 0}, "num_attention_heads: must be a positive integer"),
    ],
)
def test_unservable_fields_are_refused_by_name(change: dict[str, Any], message: str) -> None:
    hf = {**_config(), **change}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_hf_config(hf)


def test_gemma_reads_hidden_activation_not_hidden_act() -> None:
    hf = _config("tiny-gemma2")
    check_hf_config({**hf, "hidden_act": "relu2"})
    with pytest.raises(ConfigError, match="hidden_activation: 'gelu'"):
        check_hf_config({**hf, "hidden_activation": "gelu"})


def test_layer_types_follow_each_familys_hf_rule() -> None:
    llama = _config()
    assert layer_types(llama) == [FULL, FULL]
    mistral = {**_config("tiny-mistral"), "sliding_window": 4096}
    assert layer_types(mistral) == [SLIDING, SLIDING]
    qwen2 = {**_config("tiny-qwen2"), "sliding_window": 64, "max_window_layers": 1}
    assert layer_types(qwen2) == [FULL, FULL]  # use_sliding_window is off
    assert sliding_window(qwen2) is None
    qwen2["use_sliding_window"] = True
    qwen2.pop("layer_types", None)
    assert layer_types(qwen2) == [FULL, SLIDING]
    gemma2 = {**_config("tiny-gemma2"), "num_hidden_layers": 4}
    gemma2.pop("layer_types")
    assert layer_types(gemma2) == [SLIDING, FULL, SLIDING, FULL]
    gemma3 = {**_config("tiny-gemma3"), "num_hidden_layers": 12}
    gemma3.pop("layer_types")
    assert layer_types(gemma3) == ([SLIDING] * 5 + [FULL]) * 2


def test_engine_refuses_a_per_tensor_fp8_checkpoint_config_before_loading(
    tmp_path: Path,
) -> None:
    shutil.copytree(resolve_model_source("builtin:tiny-llama"), tmp_path / "m")
    hf = _config()
    hf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=r"quantization_config\.weight_block_size: None"):
        LLM(str(tmp_path / "m"))


def test_hf_config_imports_no_torch() -> None:
    code = "import sys, engine.hf_config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_defaults_table_is_the_installed_transformers() -> None:
    """engine.hf_defaults writes transformers' config-class defaults out (reading a config stays
    torch-free); a transformers upgrade that changes one fails here until it is regenerated
    (``python -m engine.hf_defaults``)."""
    import dataclasses

    from transformers import CONFIG_MAPPING

    from engine.hf_defaults import HF_CONFIG_ALIASES, HF_CONFIG_DEFAULTS, generate_defaults

    if not dataclasses.is_dataclass(CONFIG_MAPPING["llama"]):
        pytest.skip("transformers before 5: its config classes do not list their defaults")
    assert generate_defaults() == (HF_CONFIG_DEFAULTS, HF_CONFIG_ALIASES)
