"""What the engine reads from a Qwen2.5-VL or Qwen3-VL checkpoint's ``config.json``
(``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``), and what it
refuses there. Torch-free. (Qwen3-VL: a Qwen3 language model, interleaved M-RoPE, a ViT with
learned positions and deepstack mergers; same layouts, same refusals.)

Two layouts exist: the hub's (text fields at the top, ``rope_scaling: {"type": "mrope",
"mrope_section": [...]}``) and transformers 5's save (``text_config`` nested, its
``rope_parameters`` holding ``mrope_section``). ``flatten_qwen_vl`` reads both into the flat
shape of ``engine.vlm_config``: the text model's fields at the top with a plain ``default``
rope, ``mrope_section`` beside it, ``vision_config`` (defaults of ``Qwen2_5_VLVisionConfig``)
and the vision token ids (``image_token_index`` is the image pad token).

Served: images (window-attention ViT, patch merger, M-RoPE); refused by name: another rope than
the plain one under M-RoPE, a sliding window, an ``mrope_section`` that does not cover the
rotary half, a ``head_dim`` other than hidden_size / heads (HF's attention ignores it), an
activation other than SiLU in the tower, a quantized checkpoint. Videos are refused by the
processor (``multi_modal_data``), which takes images only.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ConfigError, check_positive_ints

QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
QWEN3_VL = "Qwen3VLForConditionalGeneration"
QWEN_VL_ARCHITECTURES: tuple[str, ...] = (QWEN2_5_VL, QWEN3_VL)
# The decoder family whose code runs each one's language model.
QWEN_VL_TEXT_FAMILIES: dict[str, str] = {
    QWEN2_5_VL: "Qwen2ForCausalLM",
    QWEN3_VL: "Qwen3ForCausalLM",
}
# Qwen3VLVisionConfig's defaults.
_QWEN3_VISION_DEFAULTS: dict[str, Any] = {
    "model_type": "qwen3_vl_vision",
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
# Qwen3VLTextConfig's defaults of the fields the engine reads.
_QWEN3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6, "attention_bias": False,
}  # fmt: skip
# Qwen2_5_VLVisionConfig's defaults.
_VISION_DEFAULTS: dict[str, Any] = {
    "model_type": "qwen2_5_vl_vision",
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "tokens_per_second": 4,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}
# Qwen2_5_VLConfig's token ids.
_TOKEN_DEFAULTS: dict[str, int] = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
# Qwen2_5_VLTextConfig's defaults of the fields the engine reads.
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
}  # fmt: skip
_DEFAULT_THETA = 1_000_000.0
_DEFAULT_MROPE_SECTION = [16, 24, 24]
_QWEN3_THETA = 500_000.0
_QWEN3_MROPE_SECTION = [24, 20, 20]
_SKIPPED = ("architectures", "torch_dtype", "dtype", "text_config", "vision_config", "model_type")


def flatten_qwen_vl(hf: dict[str, Any]) -> dict[str, Any]:
    """A Qwen2.5-VL / Qwen3-VL config.json (either layout) as the engine reads it."""
    arch = hf["architectures"][0]
    qwen3 = arch == QWEN3_VL
    text = dict(hf.get("text_config") or {})
    if not text:  # the hub's layout: the text fields are the top-level ones
        text = {k: v for k, v in hf.items() if k not in _SKIPPED and k not in _TOKEN_DEFAULTS}
    flat: dict[str, Any] = {**(_QWEN3_TEXT_DEFAULTS if qwen3 else _TEXT_DEFAULTS)}
    flat.update((k, v) for k, v in text.items() if k not in _SKIPPED)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    flat.pop("rope_scaling", None)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    flat["rope_parameters"] = {
        "rope_type": "default" if rope_type == "mrope" else rope_type,
        "rope_theta": rope.get(
            "rope_theta", text.get("rope_theta", _QWEN3_THETA if qwen3 else _DEFAULT_THETA)
        ),
    }
    flat.pop("rope_theta", None)
    default_section = _QWEN3_MROPE_SECTION if qwen3 else _DEFAULT_MROPE_SECTION
    flat["mrope_section"] = rope.get("mrope_section", default_section)
    # Qwen3-VL's text rotary always interleaves the sections (t h w t h w ...).
    flat["mrope_interleaved"] = qwen3
    if not flat.get("use_sliding_window"):
        flat["sliding_window"] = None  # Qwen2_5_VLTextConfig's own rule
    flat["architectures"] = [arch]
    flat["model_type"] = "qwen3_vl" if qwen3 else "qwen2_5_vl"
    flat["text_model_type"] = str(
        text.get("model_type") or ("qwen3_vl_text" if qwen3 else "qwen2_5_vl_text")
    )
    defaults = _QWEN3_VISION_DEFAULTS if qwen3 else _VISION_DEFAULTS
    vision = {**defaults, **(hf.get("vision_config") or {})}
    vision["model_type"] = defaults["model_type"]  # old checkpoints wrote "qwen2_5_vl"
    flat["vision_config"] = vision
    for key, default in _TOKEN_DEFAULTS.items():
        flat[key] = hf.get(key, default)
    flat["image_token_index"] = flat["image_token_id"]
    flat["tie_word_embeddings"] = bool(
        hf.get("tie_word_embeddings") or text.get("tie_word_embeddings", False)
    )
    for key in ("torch_dtype", "dtype", "quantization_config"):
        value = hf.get(key, text.get(key))
        if value is not None:
            flat[key] = value
    return flat


def check_qwen_vl(hf: dict[str, Any]) -> None:
    """Raise ``ConfigError`` naming the field for a flattened Qwen2.5-VL / Qwen3-VL config the
    engine cannot serve exactly (see the module docstring)."""
    arch = hf["architectures"][0]
    qwen3 = arch == QWEN3_VL
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    head_dim = int(hf.get("head_dim") or hidden // heads) if qwen3 else hidden // heads
    if not qwen3 and hf.get("head_dim") not in (None, head_dim):
        raise ConfigError(
            f"head_dim: {QWEN2_5_VL}'s attention uses hidden_size / num_attention_heads "
            f"({head_dim}), got {hf['head_dim']}"
        )
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type") != "default":
        raise ConfigError(
            f"rope_scaling.type: only 'mrope' (plain rope per section) is supported for "
            f"{arch}, got {rope.get('rope_type')!r}"
        )
    section = hf.get("mrope_section")
    if (
        not isinstance(section, list)
        or len(section) != 3
        or not all(isinstance(s, int) and s > 0 for s in section)
        or sum(section) != head_dim // 2
    ):
        raise ConfigError(
            f"rope_scaling.mrope_section: must be three positive integers summing to "
            f"head_dim / 2 ({head_dim // 2}), got {section!r}"
        )
    if hf.get("use_sliding_window"):
        raise ConfigError(f"use_sliding_window: true is not supported for {arch}")
    vision = hf.get("vision_config") or {}
    sizes = [
        "depth",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "patch_size",
        "spatial_merge_size",
        "temporal_patch_size",
        "out_hidden_size",
        "in_channels",
    ]
    sizes.append("num_position_embeddings" if qwen3 else "window_size")  # fmt: skip
    check_positive_ints(vision, sizes, prefix="vision_config.")
    if (
        vision["hidden_size"] % vision["num_heads"]
        or (vision["hidden_size"] // vision["num_heads"]) % 4
    ):
        raise ConfigError(
            f"vision_config.num_heads: must divide hidden_size ({vision['hidden_size']}) into "
            f"heads of a multiple of 4 dimensions, got {vision['num_heads']}"
        )
    if vision["out_hidden_size"] != hidden:
        raise ConfigError(
            f"vision_config.out_hidden_size: must equal hidden_size ({hidden}), got "
            f"{vision['out_hidden_size']}"
        )
    if qwen3:
        _check_qwen3_vision(vision)
    else:
        _check_qwen2_5_vision(vision)
    vocab = int(hf.get("vocab_size") or 0)
    for key in _TOKEN_DEFAULTS:
        token = hf.get(key)
        if not isinstance(token, int) or not 0 <= token < vocab:
            raise ConfigError(f"{key}: must be a token id in [0, vocab_size), got {token!r}")
    if hf.get("quantization_config") is not None:
        raise ConfigError(f"quantization_config: quantized {arch} checkpoints are not supported")


def _check_qwen3_vision(vision: dict[str, Any]) -> None:
    side = int(vision["num_position_embeddings"] ** 0.5)
    if side * side != vision["num_position_embeddings"]:
        raise ConfigError(
            f"vision_config.num_position_embeddings: must be a square (a side x side grid), "
            f"got {vision['num_position_embeddings']}"
        )
    if vision.get("hidden_act") not in ("gelu_pytorch_tanh", "gelu"):
        raise ConfigError(
            f"vision_config.hidden_act: {vision.get('hidden_act')!r} is not supported "
            "('gelu_pytorch_tanh', 'gelu')"
        )
    deepstack = vision.get("deepstack_visual_indexes")
    depth = vision["depth"]
    if not isinstance(deepstack, list) or not all(
        isinstance(i, int) and 0 <= i < depth for i in deepstack
    ):
        raise ConfigError(
            f"vision_config.deepstack_visual_indexes: must be a list of layer indexes in "
            f"[0, depth), got {deepstack!r}"
        )


def _check_qwen2_5_vision(vision: dict[str, Any]) -> None:
    unit = vision["spatial_merge_size"] * vision["patch_size"]
    if vision["window_size"] % unit:
        raise ConfigError(
            f"vision_config.window_size: must be a multiple of spatial_merge_size * patch_size "
            f"({unit}), got {vision['window_size']}"
        )
    if vision.get("hidden_act") != "silu":
        raise ConfigError(
            f"vision_config.hidden_act: {vision.get('hidden_act')!r} is not supported ('silu')"
        )
    full = vision.get("fullatt_block_indexes")
    if not isinstance(full, list) or not all(isinstance(i, int) for i in full):
        raise ConfigError(
            f"vision_config.fullatt_block_indexes: must be a list of layer indexes, got {full!r}"
        )


def image_token_count(hf: dict[str, Any], grid_thw: tuple[int, ...]) -> int:
    """Image tokens of one image of ``grid_thw`` patches: one per merged square."""
    merge = int(hf["vision_config"]["spatial_merge_size"])
    t, h, w = grid_thw
    return t * h * w // (merge * merge)


def vision_tower_params(hf: dict[str, Any]) -> int:
    """Parameters of the vision tower (``engine.models.qwen2_5_vision`` /
    ``engine.models.qwen3_vision``), for memory plans."""
    v = hf["vision_config"]
    if hf["architectures"][0] == QWEN3_VL:
        return _qwen3_vision_params(v)
    d, inter = v["hidden_size"], v["intermediate_size"]
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    merged = d * v["spatial_merge_size"] ** 2
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * (d * inter + inter) + inter * d + d
    merger = d + merged * merged + merged + merged * v["out_hidden_size"] + v["out_hidden_size"]
    return patch * d + v["depth"] * block + merger


def _qwen3_vision_params(v: dict[str, Any]) -> int:
    d, inter, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    merged = d * v["spatial_merge_size"] ** 2
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * inter + inter) + (inter * d + d)

    def merger(norm: int) -> int:
        return 2 * norm + merged * merged + merged + merged * out + out

    deepstack = len(v["deepstack_visual_indexes"]) * merger(merged)
    embed = patch * d + d + v["num_position_embeddings"] * d
    return embed + v["depth"] * block + merger(d) + deepstack
