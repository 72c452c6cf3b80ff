"""What the engine reads from a vision-language checkpoint's ``config.json`` (LLaVA), and what
it refuses there. Torch-free, like ``engine.hf_config``, which calls it.

HF nests a VLM's config: ``text_config`` (the language model: a Llama or Mistral config),
``vision_config`` (a CLIP vision tower) and the glue at the top (``image_token_index``, the
projector's activation, which vision layer feeds it). ``flatten_vlm_config`` lifts the text
config to the top, so every reader of decoder fields (KV sizing, rope, layer types, TP checks)
sees a plain decoder config, and keeps the rest beside it:

    {**text_config, "architectures": ["LlavaForConditionalGeneration"],
     "text_model_type": "llama", "vision_config": {...}, "image_token_index": ..., ...}

Fields left out take the defaults of transformers' ``LlavaConfig`` / ``CLIPVisionConfig``.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ConfigError
from engine.qwen_vl_config import QWEN_VL_ARCHITECTURES, QWEN_VL_TEXT_FAMILIES, flatten_qwen_vl

LLAVA = "LlavaForConditionalGeneration"
VLM_ARCHITECTURES: tuple[str, ...] = (LLAVA, *QWEN_VL_ARCHITECTURES)
# text_config.model_type -> the decoder family whose code runs the language model.
LLAVA_TEXT_FAMILIES: dict[str, str] = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
_LLAVA_DEFAULTS: dict[str, Any] = {
    "image_token_index": 32000,
    "projector_hidden_act": "gelu",
    "vision_feature_select_strategy": "default",
    "vision_feature_layer": -2,
    "multimodal_projector_bias": True,
}
# CLIPVisionConfig's defaults under LlavaConfig's own (a llava-1.5 tower).
_CLIP_VISION_DEFAULTS: dict[str, Any] = {
    "model_type": "clip_vision_model",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 336,
    "patch_size": 14,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
# LlamaConfig's / MistralConfig's defaults of the fields the engine reads, for a text_config
# that leaves them out (llava-1.5's names little more than its model_type and vocabulary).
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "vocab_size": 32000, "rope_theta": 10000.0,
    },
    "mistral": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "vocab_size": 32000, "rope_theta": 10000.0,
        "sliding_window": 4096,
    },
}  # fmt: skip
VISION_ACTIVATIONS: tuple[str, ...] = ("gelu", "quick_gelu", "gelu_pytorch_tanh")


def is_vlm(hf: dict[str, Any]) -> bool:
    archs = hf.get("architectures") or []
    return bool(archs) and archs[0] in VLM_ARCHITECTURES


def flatten_vlm_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A LLaVA config.json as the engine reads it (see the module docstring); any other
    config, or one already flat, unchanged (Qwen2.5-VL: ``engine.qwen_vl_config``)."""
    if is_vlm(hf) and hf["architectures"][0] in QWEN_VL_ARCHITECTURES:
        return hf if "text_model_type" in hf else flatten_qwen_vl(hf)
    if not is_vlm(hf) or "text_config" not in hf:
        return hf
    text = dict(hf.get("text_config") or {})
    model_type = str(text.get("model_type") or "llama")
    flat = {**_TEXT_DEFAULTS.get(model_type, {})}
    if "rope_parameters" in text or "rope_scaling" in text:
        flat.pop("rope_theta")  # the config's own rope fields say it
    flat.update(
        (k, v) for k, v in text.items() if k not in ("architectures", "torch_dtype", "dtype")
    )
    flat["architectures"] = [LLAVA]
    flat["text_model_type"] = model_type
    flat["vision_config"] = {**_CLIP_VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    for key, default in _LLAVA_DEFAULTS.items():
        flat[key] = hf.get(key, default)
    flat["tie_word_embeddings"] = bool(
        hf.get("tie_word_embeddings") or text.get("tie_word_embeddings", False)
    )
    for key in ("torch_dtype", "dtype", "quantization_config"):
        value = hf.get(key, text.get(key))
        if value is not None:
            flat[key] = value
    return flat


def text_family(hf: dict[str, Any]) -> str:
    """The ``XForCausalLM`` family of a flattened VLM config's language model."""
    if hf["architectures"][0] in QWEN_VL_TEXT_FAMILIES:
        return QWEN_VL_TEXT_FAMILIES[hf["architectures"][0]]
    return LLAVA_TEXT_FAMILIES[str(hf.get("text_model_type") or "llama")]


def check_llava(hf: dict[str, Any]) -> None:
    """Raise ``ConfigError`` naming the field for a LLaVA config the engine cannot serve
    exactly: another language model than Llama / Mistral, another tower than CLIP, several
    feature layers, an unknown selection strategy or activation, a quantized checkpoint."""
    model_type = hf.get("text_model_type")
    if model_type not in LLAVA_TEXT_FAMILIES:
        raise ConfigError(
            f"text_config.model_type: {model_type!r} is not supported for {LLAVA} "
            f"({', '.join(LLAVA_TEXT_FAMILIES)})"
        )
    vision = hf.get("vision_config") or {}
    if vision.get("model_type") != "clip_vision_model":
        raise ConfigError(
            f"vision_config.model_type: {vision.get('model_type')!r} is not supported "
            "('clip_vision_model')"
        )
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "image_size",
        "patch_size",
    ):
        value = vision.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"vision_config.{key}: must be a positive integer, got {value!r}")
    if vision["hidden_size"] % vision["num_attention_heads"]:
        raise ConfigError(
            f"vision_config.num_attention_heads: must divide hidden_size "
            f"({vision['hidden_size']}), got {vision['num_attention_heads']}"
        )
    if vision["image_size"] % vision["patch_size"]:
        raise ConfigError(
            f"vision_config.patch_size: must divide image_size ({vision['image_size']}), "
            f"got {vision['patch_size']}"
        )
    if vision.get("hidden_act") not in VISION_ACTIVATIONS:
        raise ConfigError(
            f"vision_config.hidden_act: {vision.get('hidden_act')!r} is not supported "
            f"({', '.join(VISION_ACTIVATIONS)})"
        )
    feature_layer(hf)
    strategy = hf.get("vision_feature_select_strategy")
    if strategy not in ("default", "full"):
        raise ConfigError(
            f"vision_feature_select_strategy: must be 'default' or 'full', got {strategy!r}"
        )
    if hf.get("projector_hidden_act") not in VISION_ACTIVATIONS:
        raise ConfigError(
            f"projector_hidden_act: {hf.get('projector_hidden_act')!r} is not supported "
            f"({', '.join(VISION_ACTIVATIONS)})"
        )
    token = hf.get("image_token_index")
    if not isinstance(token, int) or not 0 <= token < int(hf.get("vocab_size") or 0):
        raise ConfigError(
            f"image_token_index: must be a token id in [0, vocab_size), got {token!r}"
        )
    if hf.get("quantization_config") is not None:
        raise ConfigError(f"quantization_config: quantized {LLAVA} checkpoints are not supported")


def feature_layer(hf: dict[str, Any]) -> int:
    """How many vision encoder layers run: ``vision_feature_layer`` indexes HF's hidden states
    (0: the embeddings, i: layer i's output; negative from the end), so the layers past it are
    never used."""
    layer = hf.get("vision_feature_layer")
    num_layers = int((hf.get("vision_config") or {}).get("num_hidden_layers") or 0)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ConfigError(
            f"vision_feature_layer: must be one integer (a list of layers is not supported), "
            f"got {layer!r}"
        )
    index = layer if layer >= 0 else num_layers + 1 + layer
    if not 0 <= index <= num_layers:
        raise ConfigError(
            f"vision_feature_layer: must be in [-{num_layers + 1}, {num_layers}], got {layer}"
        )
    return index


def image_feature_size(hf: dict[str, Any], height: int, width: int) -> int:
    """Image tokens one image of ``height`` x ``width`` pixels becomes: its patches, plus the
    class token under the ``full`` strategy (``default`` drops it)."""
    patch = int(hf["vision_config"]["patch_size"])
    patches = (height // patch) * (width // patch)
    return patches + (1 if hf.get("vision_feature_select_strategy") == "full" else 0)
