"""Built-in tiny vision-language models: ``tiny-llava``, a seeded random-weight
``LlavaForConditionalGeneration`` (a 3-layer CLIP tower on 48x48 images in 8x8 patches, a
2-layer Llama) written in HF format with a real processor, so tests compare the engine to
HF's ``LlavaForConditionalGeneration`` + ``LlavaProcessor`` on the same images, offline.

The directory holds the tiny models' files (``engine.builtin.tiny_models``) plus
``preprocessor_config.json`` (a ``CLIPImageProcessor``: resize the short side to 48, centre
crop 48x48, CLIP's normalisation) and ``processor_config.json`` (``LlavaProcessor``); the
tokenizer is the shared one with ``<image>`` added as id 1024 (the model's
``image_token_index``). One image becomes 36 image tokens, one per patch (the class token is
dropped).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    MistralConfig,
)

from engine.builtin.tiny_models import (
    _COMMON_CONFIG,
    LM_HEAD_SCALE,
    NORM_WEIGHT_NOISE,
    SPECIAL_TOKEN_ROW_SCALE,
    SPECIAL_TOKENS,
    materialize,
)
from engine.builtin.tiny_tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IM_END_TOKEN_ID,
    PAD_TOKEN_ID,
    build_tokenizer,
    write_json,
    write_tokenizer,
)

TINY_VLM_MODEL_NAMES: tuple[str, ...] = ("tiny-llava",)
# Bump whenever the recipe changes (the cache directory is named after it).
VLM_VERSION = 1
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 48
PATCH_SIZE = 8
# The projector's output is scaled up so that an image's embeddings weigh like a token's
# (random CLIP features are small): without it two different images give the same answer.
PROJECTOR_SCALE = 4.0
_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "projection_dim": 16,
    "hidden_act": "quick_gelu",
}


def materialize_tiny_vlm(name: str) -> Path:
    if name not in TINY_VLM_MODEL_NAMES:
        valid = ", ".join(TINY_VLM_MODEL_NAMES)
        raise ValueError(f"unknown tiny VLM name {name!r}; valid names are {valid}")
    return materialize(f"{name}-vlm{VLM_VERSION}", lambda out: make_tiny_llava(out, seed=0))


def make_tiny_llava(
    out_dir: str | Path,
    seed: int = 0,
    *,
    mistral: bool = False,
    vision_overrides: dict[str, Any] | None = None,
    text_overrides: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Write ``tiny-llava`` (weights drawn from ``seed``; ``overrides`` change LlavaConfig's
    top-level fields, e.g. ``vision_feature_select_strategy="full"``, ``vision_overrides`` the
    tower's (its ``image_size`` and ``patch_size`` the processor's too), ``text_overrides`` the
    language model's; ``mistral`` makes the language model a Mistral) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens([IMAGE_TOKEN])
    image_token_id = tokenizer.token_to_id(IMAGE_TOKEN)
    text_class = MistralConfig if mistral else LlamaConfig
    text = text_class(
        **{**_COMMON_CONFIG, "vocab_size": image_token_id + 1, "num_key_value_heads": 2,
           **(text_overrides or {})},
        tie_word_embeddings=False,
    )  # fmt: skip
    vision = {**_VISION, **(vision_overrides or {})}
    image_size, patch_size = vision["image_size"], vision["patch_size"]
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**vision),
        text_config=text,
        image_token_index=image_token_id,
        image_seq_length=(image_size // patch_size) ** 2,
        **overrides,
    )
    model = _build(config, seed)
    state = {k: v.detach().contiguous().clone() for k, v in sorted(model.state_dict().items())}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    data = config.to_dict()
    data["architectures"] = ["LlavaForConditionalGeneration"]
    data["torch_dtype"] = data["dtype"] = "float32"
    write_json(out / "config.json", data)
    write_tokenizer(tokenizer, out)
    _add_image_token(out / "tokenizer_config.json", image_token_id)
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": [EOS_TOKEN_ID, IM_END_TOKEN_ID],
            "pad_token_id": PAD_TOKEN_ID,
        },
    )
    CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    ).save_pretrained(str(out))
    write_json(
        out / "processor_config.json",
        {
            "processor_class": "LlavaProcessor",
            "image_token": IMAGE_TOKEN,
            "patch_size": patch_size,
            "vision_feature_select_strategy": config.vision_feature_select_strategy,
            "num_additional_image_tokens": 1,
        },
    )
    return out


def _build(config: LlavaConfig, seed: int) -> LlavaForConditionalGeneration:
    """HF's init under ``seed``, then the tiny models' recipe (``engine.builtin.tiny_models``):
    wide weights, noisy norms and biases, a scaled LM head with quiet special-token rows."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith(("norm.weight", "layernorm.weight", "layrnorm.weight")) or (
                "layer_norm" in name and name.endswith(".weight")
            ):
                param.add_(NORM_WEIGHT_NOISE * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            elif param.dim() >= 2 or name.endswith("class_embedding"):
                # HF's 0.02 (text) and CLIP's factor-scaled inits are near-linear at this width.
                fan_in = param.numel() // param.shape[0]
                param.copy_(0.2 * noise if "language_model" in name else noise / fan_in**0.5)
        model.model.multi_modal_projector.linear_2.weight.mul_(PROJECTOR_SCALE)
        head = model.lm_head.weight
        head.mul_(LM_HEAD_SCALE)
        head[: len(SPECIAL_TOKENS)].mul_(SPECIAL_TOKEN_ROW_SCALE)
        head[config.image_token_index].mul_(SPECIAL_TOKEN_ROW_SCALE)
    return model.eval()


def _add_image_token(path: Path, token_id: int) -> None:
    config = json.loads(path.read_text())
    config["added_tokens_decoder"][str(token_id)] = {
        "content": IMAGE_TOKEN,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    write_json(path, config)
