"""Sleep mode on a worker (vLLM's levels): what a sleeping worker lets go of, and how it comes
back. The engine (``LLMEngine.sleep`` / ``wake_up``) puts every worker to sleep at once, idle.

    level 1   KV cache freed (its contents, the prefix cache, are lost); the weights stay in
              host memory: a GPU worker moves them there (pinned) and back on wake, a CPU
              worker's already are.                        wake: weights back, KV reallocated
    level 2   KV cache and weights freed.                  wake: weights reloaded from the
                                                           checkpoint, KV reallocated

Decode graphs go with the cache they read. After freeing, the allocator's cached memory goes
back to the system (CUDA's caching allocator; glibc's heap via ``malloc_trim``), so the
process's memory falls by what was freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from engine.errors import InvalidRequestError

logger = logging.getLogger("llm_cluster.worker")

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")


def check_sleep_level(level: object) -> int:
    """``level`` as a sleep level; an ``InvalidRequestError`` naming it otherwise."""
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise InvalidRequestError(f"must be one of {SLEEP_LEVELS}, got {level!r}", "level")
    return int(level)  # type: ignore[call-overload]


def check_wake_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """What a ``wake_up(tags)`` wakes, in the order it must (weights before the cache)."""
    if tags is None:
        return WAKE_TAGS
    unknown = [t for t in tags if t not in WAKE_TAGS]
    if isinstance(tags, str) or unknown or not tags:
        raise InvalidRequestError(f"a non-empty list of {list(WAKE_TAGS)}, got {tags!r}", "tags")
    return tuple(t for t in WAKE_TAGS if t in tags)


def move_weights(model: nn.Module, device: torch.device) -> None:
    """Every parameter and buffer of ``model`` to ``device`` (pinned when it is the host and
    the tensors come from a GPU, so the way back is a fast copy)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if device.type == "cpu" and t.is_cuda:
            return t.to("cpu").pin_memory()
        return t.to(device, non_blocking=True)

    model._apply(move)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_freed_memory(device: torch.device) -> None:
    """Hand what was just freed back to the system: Python's cycles collected, then the
    device allocator's cache (CUDA) and glibc's free heap pages (CPU tensors)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        logger.debug("no malloc_trim in %s: freed heap pages stay with the process", name)
        return None
