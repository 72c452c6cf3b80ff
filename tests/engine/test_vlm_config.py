"""A LLaVA / Gemma 3 vision config.json read flat (the language model's fields at the top, the
tower's beside them) and refused by field where the engine cannot serve it exactly, before
anything loads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.builtin.catalog import resolve_model_source
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.hf_config import check_hf_config
from engine.vlm_config import (
    GEMMA3_VLM,
    LLAVA,
    feature_layer,
    flatten_vlm_config,
    image_feature_size,
    max_image_tokens,
    placeholder_token_id,
    whole_image_attention,
)


def _raw() -> dict[str, Any]:
    return json.loads((resolve_model_source("builtin:tiny-llava") / "config.json").read_text())


def test_the_text_config_is_read_at_the_top_with_the_tower_beside_it() -> None:
    flat = flatten_vlm_config(_raw())
    assert flat["architectures"] == [LLAVA]
    assert (flat["hidden_size"], flat["num_hidden_layers"], flat["vocab_size"]) == (64, 2, 1025)
    assert flat["text_model_type"] == "llama"
    assert flat["vision_config"]["patch_size"] == 8
    assert flatten_vlm_config(flat) == flat
    # vision_feature_layer -2 of 3 layers: the output of layer 2, so 2 layers run.
    assert feature_layer(flat) == 2
    assert image_feature_size(flat, 48, 48) == 36
    full = {**flat, "vision_feature_select_strategy": "full"}
    assert image_feature_size(full, 48, 48) == 37
    check_hf_config(flat)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"text_model_type": "qwen2"}, "text_config.model_type: 'qwen2' is not supported"),
        ({"vision_feature_layer": [-2, -5]}, "vision_feature_layer: must be one integer"),
        ({"vision_feature_layer": -5}, r"vision_feature_layer: must be in \[-4, 3\]"),
        ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy"),
        ({"projector_hidden_act": "relu"}, "projector_hidden_act: 'relu' is not supported"),
        ({"image_token_index": 5000}, "image_token_index: must be a token id"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_what_the_engine_cannot_serve_is_refused_by_field(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_hf_config({**flatten_vlm_config(_raw()), **change})


def test_a_siglip_tower_is_refused() -> None:
    flat = flatten_vlm_config(_raw())
    flat["vision_config"] = {**flat["vision_config"], "model_type": "siglip_vision_model"}
    with pytest.raises(ConfigError, match=r"vision_config\.model_type"):
        check_hf_config(flat)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"runner": "pooling"}, "runner: .* vision-language model"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size: vision-language models"),
        ({"limit_mm_per_prompt": {"video": 1}}, "limit_mm_per_prompt: must map a modality"),
        ({"limit_mm_per_prompt": {"image": -1}}, "limit_mm_per_prompt.image"),
    ],
)
def test_engine_arguments_a_vlm_cannot_take_are_refused(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_kwargs(model="builtin:tiny-llava", **kwargs)


def test_a_hub_text_config_that_names_little_takes_hf_defaults() -> None:
    # llava-1.5-7b-hf's text_config, as the hub has it.
    raw = {
        "architectures": [LLAVA],
        "text_config": {"model_type": "llama", "vocab_size": 32064, "rms_norm_eps": 1e-5,
                        "max_position_embeddings": 4096, "torch_dtype": "float16"},
        "vision_config": {"hidden_size": 1024, "image_size": 336, "patch_size": 14,
                          "intermediate_size": 4096, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "projection_dim": 768,
                          "model_type": "clip_vision_model"},
        "image_token_index": 32000,
        "torch_dtype": "float16",
    }  # fmt: skip
    flat = flatten_vlm_config(raw)
    check_hf_config(flat)
    assert (flat["hidden_size"], flat["num_hidden_layers"], flat["vocab_size"]) == (4096, 32, 32064)
    assert (flat["rms_norm_eps"], flat["max_position_embeddings"]) == (1e-5, 4096)
    assert flat["torch_dtype"] == "float16"
    assert image_feature_size(flat, 336, 336) == 576


def _gemma3_raw() -> dict[str, Any]:
    path = resolve_model_source("builtin:tiny-gemma3-vision")
    return json.loads((path / "config.json").read_text())


def test_a_gemma3_vision_config_is_read_flat() -> None:
    flat = flatten_vlm_config(_gemma3_raw())
    assert flat["architectures"] == [GEMMA3_VLM]
    assert flat["text_model_type"] == "gemma3_text"
    assert flat["tie_word_embeddings"] is True
    assert flat["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert flat["sliding_window"] == 12
    assert flat["vision_config"]["model_type"] == "siglip_vision_model"
    assert image_feature_size(flat, 32, 32) == max_image_tokens(flat) == 16
    assert placeholder_token_id(flat) == flat["boi_token_index"]
    assert whole_image_attention(flat) and not whole_image_attention(flatten_vlm_config(_raw()))
    check_hf_config(flat)
    # A sparse config.json (the hub's usual): Gemma3Config's and SiglipVisionConfig's defaults.
    # (Gemma 3's tower: 896x896 images in 14x14 patches, a 64x64 grid pooled to 16x16.)
    sparse = flatten_vlm_config(
        {
            "architectures": [GEMMA3_VLM],
            "text_config": {"model_type": "gemma3_text"},
            "vision_config": {"image_size": 896, "patch_size": 14},
        }
    )
    assert (sparse["mm_tokens_per_image"], sparse["image_token_index"]) == (256, 262144)
    assert sparse["vision_config"]["hidden_size"] == 768 and sparse["tie_word_embeddings"]
    check_hf_config(sparse)
    # SiglipVisionConfig's own 224 / 16 grid (14x14) does not pool to 16x16: refused.
    with pytest.raises(ConfigError, match="mm_tokens_per_image: must be a square"):
        check_hf_config(
            {
                **sparse,
                "vision_config": {**sparse["vision_config"], "image_size": 224, "patch_size": 16},
            }
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"text_model_type": "llama"}, "text_config.model_type: 'llama' is not supported"),
        ({"mm_tokens_per_image": 15}, "mm_tokens_per_image: must be a square"),
        ({"mm_tokens_per_image": 9}, "mm_tokens_per_image: must be a square"),  # 3 !| 8
        ({"boi_token_index": 5000}, "boi_token_index: must be a token id"),
        ({"image_token_index": -1}, "image_token_index: must be a token id"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ],
)
def test_what_gemma3_vision_cannot_serve_is_refused_by_field(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_hf_config({**flatten_vlm_config(_gemma3_raw()), **change})


def test_gemma3_vision_refuses_a_clip_tower() -> None:
    flat = flatten_vlm_config(_gemma3_raw())
    flat["vision_config"] = {**flat["vision_config"], "model_type": "clip_vision_model"}
    with pytest.raises(ConfigError, match=r"vision_config\.model_type"):
        check_hf_config(flat)
