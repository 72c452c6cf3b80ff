"""Model sources: a local checkpoint directory, or ``builtin:<name>``, one of the generated
random-weight models (dense ``engine.builtin.tiny_models``, MoE ``engine.builtin.tiny_moe_models``,
reasoning ``engine.builtin.tiny_reasoning_models``, pooling
``engine.builtin.tiny_pooling_models``, vision-language ``engine.builtin.tiny_vlm_models`` and
``tiny_qwen_vl_models``), written once into the cache; plus random LoRA adapters for them.

A built-in already written resolves through ``engine.builtin.builtin_names`` alone; the
generators (torch, transformers' modeling stack) are imported only to write one, so a start
with a built-in pays them once, not in every process. It sits above the generator modules,
which never import it."""

from __future__ import annotations

import os
from pathlib import Path

from engine.builtin.builtin_names import (
    BUILTIN_MODEL_NAMES,
    TINY_MOE_MODEL_NAMES,
    TINY_POOLING_MODEL_NAMES,
    TINY_QWEN_VL_MODEL_NAMES,
    TINY_REASONING_MODEL_NAMES,
    TINY_VLM_MODEL_NAMES,
    builtin_dirname,
    written_builtin,
)

__all__ = ["BUILTIN_MODEL_NAMES", "BUILTIN_PREFIX", "make_tiny_lora", "resolve_model_source"]

BUILTIN_PREFIX = "builtin:"


def resolve_model_source(source: str) -> Path:
    """Turn a model source into a local checkpoint directory.

    ``builtin:<name>`` is materialized once into ``<cache_dir>/models/<name>-v<VERSION>``
    (``engine.builtin.builtin_names`` names it); any other string is a local directory that
    must hold a ``config.json``. Nothing is downloaded.
    """
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX) :]
        return written_builtin(name) or _materialize_builtin(name)
    path = Path(source).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model source {source!r}: {path} is not a directory with a config.json "
            f"(a local path, s3://bucket/prefix, or a built-in: "
            f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_MODEL_NAMES)})"
        )
    return path


def _materialize_builtin(name: str) -> Path:
    """Write the built-in ``name`` (its generator imported now: see the module docstring)."""
    builtin_dirname(name)  # an unknown name: the ValueError listing the built-ins
    if name in TINY_MOE_MODEL_NAMES:
        from engine.builtin.tiny_moe_models import materialize_tiny_moe

        return materialize_tiny_moe(name)
    if name in TINY_REASONING_MODEL_NAMES:
        from engine.builtin.tiny_reasoning_models import materialize_tiny_reasoning

        return materialize_tiny_reasoning(name)
    if name in TINY_POOLING_MODEL_NAMES:
        from engine.builtin.tiny_pooling_models import materialize_tiny_pooling

        return materialize_tiny_pooling(name)
    if name in TINY_VLM_MODEL_NAMES:
        from engine.builtin.tiny_vlm_models import materialize_tiny_vlm

        return materialize_tiny_vlm(name)
    if name in TINY_QWEN_VL_MODEL_NAMES:
        from engine.builtin.tiny_qwen_vl_models import materialize_tiny_qwen_vl

        return materialize_tiny_qwen_vl(name)
    from engine.builtin.tiny_models import make_tiny_model, materialize

    return materialize(builtin_dirname(name), lambda out: make_tiny_model(name, out, seed=0))


def make_tiny_lora(
    base_name: str,
    out_dir: str | os.PathLike[str],
    rank: int = 8,
    target_modules: tuple[str, ...] | list[str] = ("q_proj", "v_proj"),
    seed: int = 0,
    *,
    lora_alpha: float | None = None,
    use_rslora: bool = False,
    scale: float = 1.0,
) -> Path:
    """Write a PEFT LoRA adapter with random A and B (PEFT itself starts B at 0, a no-op) for
    the model ``base_name`` (a built-in name like ``tiny-llama``, ``builtin:<name>`` or a local
    directory) into ``out_dir``: ``adapter_config.json`` + ``adapter_model.safetensors``,
    loadable with ``PeftModel.from_pretrained``. ``scale`` multiplies B (how far the adapter
    moves the model). Same arguments, same files."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    source = base_name if ":" in base_name or os.sep in base_name else BUILTIN_PREFIX + base_name
    base = AutoModelForCausalLM.from_pretrained(resolve_model_source(source), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=lora_alpha if lora_alpha is not None else 2 * rank,
        target_modules=list(target_modules),
        init_lora_weights=False,
        use_rslora=use_rslora,
        lora_dropout=0.0,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if ".lora_A." in name:
                param.copy_(
                    torch.randn(param.shape, generator=generator, dtype=param.dtype)
                    / param.shape[1] ** 0.5
                )
            elif ".lora_B." in name:
                param.copy_(
                    scale
                    * torch.randn(param.shape, generator=generator, dtype=param.dtype)
                    / rank**0.5
                )
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out
