"""Built-in tiny vision-language models: ``tiny-llava``, a seeded random-weight
``LlavaForConditionalGeneration`` (a 3-layer CLIP tower on 48x48 images in 8x8 patches, a
2-layer Llama), and ``tiny-gemma3-vision`` (``make_tiny_gemma3_vision``: a SigLIP tower and a
sliding-window Gemma 3), written in HF format with a real processor, so tests compare the
engine to HF's model + processor on the same images, offline.

The directory holds the tiny models' files (``engine.builtin.tiny_models``) plus
``preprocessor_config.json`` (a ``CLIPImageProcessor``: resize the short side to 48, centre
crop 48x48, CLIP's normalisation) and ``processor_config.json`` (``LlavaProcessor``); the
tokenizer is the shared one with ``<image>`` added as id 1024 (the model's
``image_token_index``). One image becomes 36 image tokens, one per patch (the class token is
dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessor,
    Gemma3TextConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    SiglipVisionConfig,
)

from engine.builtin.builtin_names import builtin_dirname
from engine.builtin.tiny_models import (
    _COMMON_CONFIG,
    _DROPPED_KEYS,
    _GEMMA_BRANCH_NORMS,
    _MODEL_CONFIGS,
    GEMMA_BRANCH_NORM_OFFSET,
    LM_HEAD_SCALE,
    NORM_WEIGHT_NOISE,
    SPECIAL_TOKEN_ROW_SCALE,
    SPECIAL_TOKENS,
    materialize,
    save_weights,
)
from engine.builtin.tiny_tokenizer import (
    GENERATION_CONFIG,
    build_tokenizer,
    declare_special_tokens,
    write_json,
    write_tokenizer,
)

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
    makers = {"tiny-llava": make_tiny_llava, "tiny-gemma3-vision": make_tiny_gemma3_vision}
    return materialize_vlm(name, makers)


def materialize_vlm(name: str, makers: dict[str, Callable[..., Path]]) -> Path:
    """The built-in VLM ``name``, written by its maker in ``makers`` (seed 0) into the cache
    once per recipe version (``engine.builtin.builtin_names``)."""
    if name not in makers:
        valid = ", ".join(makers)
        raise ValueError(f"unknown tiny VLM name {name!r}; valid names are {valid}")
    return materialize(builtin_dirname(name), lambda out: makers[name](out, seed=0))


def seeded_vlm(
    model_class: type[PreTrainedModel], config: PretrainedConfig, seed: int
) -> tuple[PreTrainedModel, torch.Generator]:
    """HF's init of ``model_class(config)`` in float32 under ``seed`` (the caller's global RNG
    left as it was), and the generator (``seed + 1``) the recipe draws its noise from."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32)
    return model, torch.Generator().manual_seed(seed + 1)


def quiet_lm_head(model: PreTrainedModel, rows: list[int | slice]) -> None:
    """The tiny recipe's LM head: scaled, with the shared special tokens' rows and the VLM's
    own token ``rows`` made quiet (so greedy output is ordinary text)."""
    head = model.lm_head.weight
    head.mul_(LM_HEAD_SCALE)
    for row in [slice(None, len(SPECIAL_TOKENS)), *rows]:
        head[row].mul_(SPECIAL_TOKEN_ROW_SCALE)


def write_vlm_checkpoint(
    out: Path,
    model: PreTrainedModel,
    config: PretrainedConfig,
    tokenizer: Tokenizer,
    added_tokens: dict[str, int],
    *,
    tied: bool = False,
    **tokenizer_fields: Any,
) -> None:
    """A tiny VLM's files but the processor's into ``out``: the weights (a ``tied`` LM head
    stored once, under the embedding's name), HF's config with the architecture and dtype, the
    shared tokenizer with ``added_tokens`` (content -> id) declared special and
    ``tokenizer_fields`` set in its config, and the generation config."""
    state = model.state_dict()
    if tied:
        state.pop("lm_head.weight", None)
    save_weights(state, out / "model.safetensors")
    data = config.to_dict()
    data["architectures"] = [type(model).__name__]
    data["torch_dtype"] = data["dtype"] = "float32"
    write_json(out / "config.json", data)
    write_tokenizer(tokenizer, out)
    declare_special_tokens(out, added_tokens, **tokenizer_fields)
    write_json(out / "generation_config.json", GENERATION_CONFIG)


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
    write_vlm_checkpoint(out, model, config, tokenizer, {IMAGE_TOKEN: image_token_id})
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
    model, generator = seeded_vlm(LlavaForConditionalGeneration, config, seed)
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
        quiet_lm_head(model, [config.image_token_index])
    return model.eval()


# tiny-gemma3-vision: a 2-layer SigLIP tower on 32x32 images in 4x4 patches (an 8x8 grid),
# average-pooled 2x2 to 16 tokens an image; the language model is tiny-gemma3's (two sliding
# layers and a global one) with a window of 12, shorter than one image's 16 tokens, so image
# spans cross it. Gemma 3's tokens are added to the shared tokenizer.
GEMMA3_IMAGE_SIZE = 32
GEMMA3_PATCH_SIZE = 4
GEMMA3_TOKENS_PER_IMAGE = 16
GEMMA3_WINDOW = 12
BOI_TOKEN, EOI_TOKEN, IMAGE_SOFT_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
_SIGLIP: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": GEMMA3_IMAGE_SIZE,
    "patch_size": GEMMA3_PATCH_SIZE,
    "hidden_act": "gelu_pytorch_tanh",
    "vision_use_head": False,
}
# The projector's output weighs like a token's embedding (sqrt(64) = 8 times a unit row).
GEMMA3_PROJECTOR_SCALE = 8.0


def make_tiny_gemma3_vision(
    out_dir: str | Path,
    seed: int = 0,
    *,
    vision_overrides: dict[str, Any] | None = None,
    text_overrides: dict[str, Any] | None = None,
    newline_tokens: bool = False,
    **overrides: Any,
) -> Path:
    """Write ``tiny-gemma3-vision`` (weights drawn from ``seed``; ``overrides`` change
    Gemma3Config's top-level fields, ``vision_overrides`` the tower's, ``text_overrides`` the
    language model's) with a ``Gemma3ImageProcessor`` and a ``Gemma3Processor`` config.
    ``newline_tokens``: runs of 2 to 4 newlines are one token each, as in Gemma's vocabulary
    (the shared tokenizer has only single newlines)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens([BOI_TOKEN, EOI_TOKEN, IMAGE_SOFT_TOKEN])
    boi, eoi, soft = (tokenizer.token_to_id(t) for t in (BOI_TOKEN, EOI_TOKEN, IMAGE_SOFT_TOKEN))
    if newline_tokens:
        tokenizer.add_tokens(["\n\n", "\n\n\n", "\n\n\n\n"])
    specific = dict(_MODEL_CONFIGS["tiny-gemma3"][1])
    text_kwargs = {**_COMMON_CONFIG, **specific, "sliding_window": GEMMA3_WINDOW}
    for key in _DROPPED_KEYS["tiny-gemma3"]:
        text_kwargs.pop(key, None)
    vocab = tokenizer.get_vocab_size()
    text = Gemma3TextConfig(**{**text_kwargs, "vocab_size": vocab, **(text_overrides or {})})
    vision = {**_SIGLIP, **(vision_overrides or {})}
    tokens = overrides.pop("mm_tokens_per_image", GEMMA3_TOKENS_PER_IMAGE)
    config = Gemma3Config(
        text_config=text,
        vision_config=SiglipVisionConfig(**vision),
        mm_tokens_per_image=tokens,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=soft,
        **overrides,
    )
    # Gemma3Processor reads its tokens, by name, from the tokenizer's extra_special_tokens.
    write_vlm_checkpoint(
        out, _build_gemma3(config, seed), config, tokenizer,
        {BOI_TOKEN: boi, EOI_TOKEN: eoi, IMAGE_SOFT_TOKEN: soft}, tied=True,
        extra_special_tokens={"boi_token": BOI_TOKEN, "eoi_token": EOI_TOKEN,
                              "image_token": IMAGE_SOFT_TOKEN},
    )  # fmt: skip
    size = vision["image_size"]
    Gemma3ImageProcessor(size={"height": size, "width": size}).save_pretrained(str(out))
    write_json(
        out / "processor_config.json",
        {"processor_class": "Gemma3Processor", "image_seq_length": tokens},
    )
    return out


def _build_gemma3(config: Gemma3Config, seed: int) -> Gemma3ForConditionalGeneration:
    """HF's init under ``seed``, then the tiny recipe: noisy norms and biases, tower weights at
    unit gain, Gemma's loud branch norms, a scaled LM head with quiet special-token rows."""
    model, generator = seeded_vlm(Gemma3ForConditionalGeneration, config, seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight") or ("layer_norm" in name and name.endswith(".weight")):
                param.add_(NORM_WEIGHT_NOISE * noise)
                if "language_model" in name and name.endswith(_GEMMA_BRANCH_NORMS):
                    param.add_(GEMMA_BRANCH_NORM_OFFSET)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            elif "vision_tower" in name and param.dim() >= 2:
                param.copy_(noise / (param.numel() // param.shape[0]) ** 0.5)
            elif name.endswith("mm_input_projection_weight"):
                param.copy_(GEMMA3_PROJECTOR_SCALE * noise / param.shape[0] ** 0.5)
        # The head is tied to the embedding: its rows are the embedding's.
        quiet_lm_head(
            model, [config.boi_token_index, config.eoi_token_index, config.image_token_index]
        )
    return model.eval()
