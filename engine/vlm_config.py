"""What the engine reads from a vision-language checkpoint's ``config.json`` (LLaVA, Gemma 3),
and what it refuses there. Torch-free, like ``engine.hf_config``, which calls it.

HF nests a VLM's config: ``text_config`` (the language model: a Llama / Mistral / Gemma 3
config), ``vision_config`` (a CLIP or SigLIP vision tower) and the glue at the top
(``image_token_index``, the projector's fields). ``flatten_vlm_config`` lifts the text config
to the top, so every reader of decoder fields (KV sizing, rope, layer types, TP checks) sees a
plain decoder config, and keeps the rest beside it:

    {**text_config, "architectures": ["LlavaForConditionalGeneration"],
     "text_model_type": "llama", "vision_config": {...}, "image_token_index": ..., ...}

Fields left out take the defaults of transformers' ``LlavaConfig`` / ``CLIPVisionConfig`` /
``Gemma3Config`` / ``SiglipVisionConfig`` (Qwen2.5-VL / Qwen3-VL: ``engine.qwen_vl_config``).
``image_feature_size``: the placeholder tokens one image becomes; ``whole_image_attention``:
whether an image's tokens attend to each other both ways (Gemma 3; the scheduler and the
attention mask honour it).
"""

from __future__ import annotations

import copy
from typing import Any

from engine.errors import ConfigError, check_positive_ints
from engine.hf_defaults import HF_CONFIG_DEFAULTS, HF_MODEL_TYPES
from engine.qwen_vl_config import QWEN_VL_ARCHITECTURES, QWEN_VL_TEXT_FAMILIES, flatten_qwen_vl

LLAVA = "LlavaForConditionalGeneration"
GEMMA3_VLM = "Gemma3ForConditionalGeneration"
VLM_ARCHITECTURES: tuple[str, ...] = (LLAVA, GEMMA3_VLM, *QWEN_VL_ARCHITECTURES)
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
VISION_ACTIVATIONS: tuple[str, ...] = ("gelu", "quick_gelu", "gelu_pytorch_tanh")
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "mm_tokens_per_image": 256,
    "boi_token_index": 255_999,
    "eoi_token_index": 256_000,
    "image_token_index": 262_144,
}
_SIGLIP_VISION_DEFAULTS: dict[str, Any] = {
    "model_type": "siglip_vision_model",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "vision_use_head": True,
}
# Gemma3TextConfig's rope, one per layer type (its class builds it: not in HF_CONFIG_DEFAULTS).
_GEMMA3_TEXT_ROPE: dict[str, Any] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
}
_TEXT_ARCHITECTURES = {model_type: arch for arch, model_type in HF_MODEL_TYPES.items()}


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
    arch = hf["architectures"][0]
    text = dict(hf.get("text_config") or {})
    gemma3 = arch == GEMMA3_VLM
    model_type = str(text.get("model_type") or ("gemma3_text" if gemma3 else "llama"))
    # The text config class's defaults (LlamaConfig's, ...), for a text_config that leaves them
    # out (llava-1.5's names little more than its model_type and vocabulary).
    flat = copy.deepcopy(HF_CONFIG_DEFAULTS.get(_TEXT_ARCHITECTURES.get(model_type, ""), {}))
    if gemma3:
        flat["rope_parameters"] = copy.deepcopy(_GEMMA3_TEXT_ROPE)
    if "rope_parameters" in text or "rope_scaling" in text or "rope_theta" in text:
        # the config's own rope fields say it
        flat.pop("rope_theta", None)
        flat.pop("rope_parameters", None)
    flat.update(
        (k, v) for k, v in text.items() if k not in ("architectures", "torch_dtype", "dtype")
    )
    flat["architectures"] = [arch]
    flat["text_model_type"] = model_type
    vision_defaults = _SIGLIP_VISION_DEFAULTS if gemma3 else _CLIP_VISION_DEFAULTS
    flat["vision_config"] = {**vision_defaults, **(hf.get("vision_config") or {})}
    for key, default in (_GEMMA3_DEFAULTS if gemma3 else _LLAVA_DEFAULTS).items():
        flat[key] = hf.get(key, default)
    # Gemma 3 ties by default (Gemma3Config's True); LLaVA's language models do not.
    flat["tie_word_embeddings"] = bool(
        hf.get("tie_word_embeddings", gemma3) or text.get("tie_word_embeddings", False)
    )
    for key in ("torch_dtype", "dtype", "quantization_config"):
        value = hf.get(key, text.get(key))
        if value is not None:
            flat[key] = value
    return flat


def text_family(hf: dict[str, Any]) -> str:
    """The ``XForCausalLM`` family of a flattened VLM config's language model."""
    if hf["architectures"][0] == GEMMA3_VLM:
        return "Gemma3ForCausalLM"
    if hf["architectures"][0] in QWEN_VL_TEXT_FAMILIES:
        return QWEN_VL_TEXT_FAMILIES[hf["architectures"][0]]
    return LLAVA_TEXT_FAMILIES[str(hf.get("text_model_type") or "llama")]


def placeholder_token_id(hf: dict[str, Any]) -> int:
    """The token a prompt holds once per image before expansion (Gemma 3: ``<start_of_image>``;
    LLaVA: the image token itself)."""
    key = "boi_token_index" if hf["architectures"][0] == GEMMA3_VLM else "image_token_index"
    return int(hf[key])


def whole_image_attention(hf: dict[str, Any]) -> bool:
    """Whether one image's placeholder tokens attend to each other both ways (Gemma 3), so a
    prefill chunk must hold an image's tokens whole (vLLM's ``disable_chunked_mm_input``)."""
    return is_vlm(hf) and hf["architectures"][0] == GEMMA3_VLM


def max_image_tokens(hf: dict[str, Any]) -> int:
    """The most placeholder tokens one image of this model becomes (Gemma 3: all the same)."""
    if hf["architectures"][0] == GEMMA3_VLM:
        return int(hf["mm_tokens_per_image"])
    size = int(hf["vision_config"]["image_size"])
    return image_feature_size(hf, size, size)


def check_gemma3_vlm(hf: dict[str, Any]) -> None:
    """Raise ``ConfigError`` naming the field for a Gemma 3 vision config the engine cannot
    serve exactly: another tower than SigLIP, a tower whose patch grid does not pool evenly to
    ``mm_tokens_per_image``, bad token ids, a quantized checkpoint."""
    model_type = hf.get("text_model_type")
    if model_type not in ("gemma3_text", "gemma3"):
        raise ConfigError(
            f"text_config.model_type: {model_type!r} is not supported for {GEMMA3_VLM} "
            "('gemma3_text')"
        )
    vision = _check_tower(hf, "siglip_vision_model")
    tokens = hf.get("mm_tokens_per_image")
    patches = vision["image_size"] // vision["patch_size"]
    side = round(tokens**0.5) if isinstance(tokens, int) and tokens > 0 else 0
    if side * side != tokens or patches % side:
        raise ConfigError(
            f"mm_tokens_per_image: must be a square whose side divides the tower's "
            f"{patches}x{patches} patch grid, got {tokens!r}"
        )
    vocab = int(hf.get("vocab_size") or 0)
    for key in ("image_token_index", "boi_token_index", "eoi_token_index"):
        token = hf.get(key)
        if not isinstance(token, int) or not 0 <= token < vocab:
            raise ConfigError(f"{key}: must be a token id in [0, vocab_size), got {token!r}")
    if hf.get("quantization_config") is not None:
        raise ConfigError(
            f"quantization_config: quantized {GEMMA3_VLM} checkpoints are not supported"
        )


def _check_tower(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ``vision_config`` of a ``model_type`` tower (CLIP's or SigLIP's) the engine builds
    exactly: its sizes, patch grid and activation; ``ConfigError`` naming the field otherwise."""
    vision = hf.get("vision_config") or {}
    if vision.get("model_type") != model_type:
        raise ConfigError(
            f"vision_config.model_type: {vision.get('model_type')!r} is not supported "
            f"({model_type!r})"
        )
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "image_size", "patch_size")  # fmt: skip
    check_positive_ints(vision, sizes, prefix="vision_config.")
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
    return vision


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
    _check_tower(hf, "clip_vision_model")
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
    class token under the ``full`` strategy (``default`` drops it); Gemma 3's pooled
    ``mm_tokens_per_image`` whatever the size."""
    if hf["architectures"][0] == GEMMA3_VLM:
        return int(hf["mm_tokens_per_image"])
    patch = int(hf["vision_config"]["patch_size"])
    patches = (height // patch) * (width // patch)
    return patches + (1 if hf.get("vision_feature_select_strategy") == "full" else 0)
