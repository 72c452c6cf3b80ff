"""The built-in models' names and where each is cached, without their generators.

    builtin:<name> ── builtin_dir(name) holds a config.json? ── yes: that directory
                                                            └─ no: the catalog writes it
                                                               (``engine.builtin.catalog``)

Every start after the first finds its built-in written, so a process that checks or loads
``configs/tiny.yaml`` reads only this module, not the generators (torch and transformers'
modeling stack, 1-3 s per process on 2 cores; each replica, head and worker checks its
config). A family's recipe version is part of its directory name: bump it here when the recipe
changes, and a cache written by an older recipe is never mistaken for the current one.
"""

from __future__ import annotations

from pathlib import Path

from engine import envs

# The dense recipe (corpus, tokenizer, init, config), shared by every family built on it.
VERSION = 6
MOE_VERSION = 2  # on top of VERSION
HARMONY_VERSION = 1  # tiny-gpt-oss's tokenizer files (its chat template)
POOLING_VERSION = 1  # on top of VERSION
REASONING_VERSION = 1  # on top of VERSION
VLM_VERSION = 1  # LLaVA, Gemma 3 vision
QWEN_VL_VERSION = 1  # Qwen2.5-VL, Qwen3-VL

TINY_MODEL_NAMES: tuple[str, ...] = (
    "tiny-llama",
    "tiny-mistral",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-phi3",
)
TINY_MOE_MODEL_NAMES: tuple[str, ...] = (
    "tiny-mixtral",
    "tiny-qwen2-moe",
    "tiny-qwen3-moe",
    "tiny-deepseek-v3",
    "tiny-deepseek-v2",
    "tiny-glm4-moe",
    "tiny-gpt-oss",
)
TINY_POOLING_MODEL_NAMES: tuple[str, ...] = (
    "tiny-qwen3-classifier",
    "tiny-llama-cross-encoder",
    "tiny-qwen3-embedding",
)
TINY_REASONING_MODEL_NAMES: tuple[str, ...] = ("tiny-qwen3-reasoning",)
TINY_VLM_MODEL_NAMES: tuple[str, ...] = ("tiny-llava", "tiny-gemma3-vision")
TINY_QWEN_VL_MODEL_NAMES: tuple[str, ...] = ("tiny-qwen2.5-vl", "tiny-qwen3-vl")

BUILTIN_MODEL_NAMES: tuple[str, ...] = (
    TINY_MODEL_NAMES
    + TINY_MOE_MODEL_NAMES
    + TINY_REASONING_MODEL_NAMES
    + TINY_POOLING_MODEL_NAMES
    + TINY_VLM_MODEL_NAMES
    + TINY_QWEN_VL_MODEL_NAMES
)


def builtin_dirname(name: str) -> str:
    """The cache directory's name of the built-in ``name`` (its recipe versions in it); a
    ``ValueError`` listing the built-ins for any other name."""
    if name in TINY_MODEL_NAMES:
        return f"{name}-v{VERSION}"
    if name in TINY_MOE_MODEL_NAMES:
        harmony = f".h{HARMONY_VERSION}" if name == "tiny-gpt-oss" else ""
        return f"{name}-v{VERSION}.{MOE_VERSION}{harmony}"
    if name in TINY_POOLING_MODEL_NAMES:
        return f"{name}-v{VERSION}.{POOLING_VERSION}"
    if name in TINY_REASONING_MODEL_NAMES:
        return f"{name}-v{VERSION}.{REASONING_VERSION}"
    if name in TINY_VLM_MODEL_NAMES:
        return f"{name}-vlm{VLM_VERSION}"
    if name in TINY_QWEN_VL_MODEL_NAMES:
        return f"{name}-vlm{QWEN_VL_VERSION}"
    raise ValueError(
        f"unknown tiny model name {name!r}; valid names are {', '.join(BUILTIN_MODEL_NAMES)}"
    )


def builtin_dir(name: str) -> Path:
    """Where the built-in ``name`` is (or will be) written: ``<cache_dir>/models/<dirname>``."""
    return envs.cache_dir() / "models" / builtin_dirname(name)


def written_builtin(name: str) -> Path | None:
    """The built-in's directory when it is already written (it holds a ``config.json``: the
    writer renames a whole directory into place), else None."""
    path = builtin_dir(name)
    return path if (path / "config.json").is_file() else None


__all__ = [
    "BUILTIN_MODEL_NAMES",
    "TINY_MODEL_NAMES",
    "TINY_MOE_MODEL_NAMES",
    "TINY_POOLING_MODEL_NAMES",
    "TINY_QWEN_VL_MODEL_NAMES",
    "TINY_REASONING_MODEL_NAMES",
    "TINY_VLM_MODEL_NAMES",
    "VERSION",
    "builtin_dir",
    "builtin_dirname",
    "written_builtin",
]
