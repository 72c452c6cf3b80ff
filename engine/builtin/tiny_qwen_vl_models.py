"""Built-in ``tiny-qwen2.5-vl``: a seeded random-weight ``Qwen2_5_VLForConditionalGeneration``
(a 4-layer window-attention ViT, layers 1 and 3 full attention, 14-pixel patches, 2x2 patch
merger; a 2-layer Qwen2 language model with M-RoPE section [2, 3, 3]) written in HF format
with HF's own processor files, so tests compare the engine to HF's model + processor offline.

The processor is ``Qwen2VLImageProcessor`` (smart_resize to multiples of 28 within
``min_pixels`` / ``max_pixels``, patch 14, temporal patch 2, merge 2, CLIP normalisation) under
``Qwen2_5_VLProcessor``. The tokenizer is the shared tiny one
(``engine.builtin.tiny_tokenizer``) with Qwen's ``<|vision_start|>``, ``<|vision_end|>``,
``<|image_pad|>`` and ``<|video_pad|>`` added after it. A 56x84 image is a 4x6 patch grid,
merged to 2x3 = 6 image tokens; the window (56 pixels = 2x2 merged patches) splits it.

``tiny-qwen3-vl``: a ``Qwen3VLForConditionalGeneration`` the same way (a 3-layer ViT on 16-pixel
patches with a 4x4 learned position table, deepstack from layers 0 and 1; a 3-layer Qwen3 with
interleaved M-RoPE [2, 3, 3]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from engine.builtin.tiny_models import (
    _COMMON_CONFIG,
    NORM_WEIGHT_NOISE,
)
from engine.builtin.tiny_tokenizer import build_tokenizer, write_json
from engine.builtin.tiny_vlm_models import (
    materialize_vlm,
    quiet_lm_head,
    seeded_vlm,
    write_vlm_checkpoint,
)

VISION_TOKENS: tuple[str, ...] = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
MIN_PIXELS = 28 * 28
MAX_PIXELS = 28 * 28 * 64
# Qwen3-VL's 16-pixel patches: at least 2x2 and at most 64 merged squares of 32 pixels.
QWEN3_MIN_PIXELS = 64 * 64
QWEN3_MAX_PIXELS = 32 * 32 * 64
# The merger's output is scaled up so that an image's embeddings weigh like a token's.
MERGER_SCALE = 4.0
_VISION: dict[str, Any] = {
    "depth": 4,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1, 3],
    "hidden_act": "silu",
    "tokens_per_second": 2,
}
_QWEN3_VISION: dict[str, Any] = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 1],
    "hidden_act": "gelu_pytorch_tanh",
}


def materialize_tiny_qwen_vl(name: str) -> Path:
    makers = {"tiny-qwen2.5-vl": make_tiny_qwen2_5_vl, "tiny-qwen3-vl": make_tiny_qwen3_vl}
    return materialize_vlm(name, makers)


def make_tiny_qwen2_5_vl(
    out_dir: str | Path,
    seed: int = 0,
    *,
    vision_overrides: dict[str, Any] | None = None,
    text_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write ``tiny-qwen2.5-vl`` (weights drawn from ``seed``; ``vision_overrides`` /
    ``text_overrides`` change the tower's / language model's config) into ``out_dir``."""
    return _make(out_dir, seed, False, vision_overrides or {}, text_overrides or {})


def make_tiny_qwen3_vl(
    out_dir: str | Path,
    seed: int = 0,
    *,
    vision_overrides: dict[str, Any] | None = None,
    text_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write ``tiny-qwen3-vl`` (as :func:`make_tiny_qwen2_5_vl`) into ``out_dir``."""
    return _make(out_dir, seed, True, vision_overrides or {}, text_overrides or {})


def _make(
    out_dir: str | Path,
    seed: int,
    qwen3: bool,
    vision_overrides: dict[str, Any],
    text_overrides: dict[str, Any],
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(list(VISION_TOKENS))
    ids = {t: tokenizer.token_to_id(t) for t in VISION_TOKENS}
    text = {
        **_COMMON_CONFIG,
        "model_type": "qwen3_vl_text" if qwen3 else "qwen2_5_vl_text",
        "vocab_size": max(ids.values()) + 1,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [2, 3, 3]},
        **({"num_hidden_layers": 3} if qwen3 else {}),
        **text_overrides,
    }  # fmt: skip
    text.pop("rope_theta", None)
    base = _QWEN3_VISION if qwen3 else _VISION
    vision = {**base, "out_hidden_size": text["hidden_size"], **vision_overrides}
    config_class = Qwen3VLConfig if qwen3 else Qwen2_5_VLConfig
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    write_vlm_checkpoint(out, _build(config, seed, qwen3), config, tokenizer, ids)
    write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor",
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "resample": 3,
            "rescale_factor": 1 / 255,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "min_pixels": QWEN3_MIN_PIXELS if qwen3 else MIN_PIXELS,
            "max_pixels": QWEN3_MAX_PIXELS if qwen3 else MAX_PIXELS,
            "patch_size": vision["patch_size"],
            "temporal_patch_size": vision["temporal_patch_size"],
            "merge_size": vision["spatial_merge_size"],
        },
    )
    processor = "Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor"
    write_json(out / "processor_config.json", {"processor_class": processor})
    return out


def _build(config: Any, seed: int, qwen3: bool) -> PreTrainedModel:
    """HF's init under ``seed``, then the tiny models' recipe (``engine.builtin.tiny_models``):
    wide weights, noisy norms and biases, a scaled LM head with quiet special-token rows."""
    model_class = Qwen3VLForConditionalGeneration if qwen3 else Qwen2_5_VLForConditionalGeneration
    model, generator = seeded_vlm(model_class, config, seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name or name.endswith("ln_q.weight"):
                param.add_(NORM_WEIGHT_NOISE * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            elif param.dim() >= 2:
                fan_in = param.numel() // param.shape[0]
                param.copy_(0.2 * noise if "language_model" in name else noise / fan_in**0.5)
        if qwen3:
            model.model.visual.merger.linear_fc2.weight.mul_(MERGER_SCALE)
            for merger in model.model.visual.deepstack_merger_list:
                merger.linear_fc2.weight.mul_(MERGER_SCALE)
        else:
            model.model.visual.merger.mlp[2].weight.mul_(MERGER_SCALE)
        first_vision_token = min(config.vision_start_token_id, config.image_token_id)
        quiet_lm_head(model, [slice(first_vision_token, None)])
    return model.eval()
