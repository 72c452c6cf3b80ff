"""The argument checks every paged-attention path shares (the torch kernels in
``llm_kernels.attention``, the Triton kernels, the MLA kernel, the cache writers): shapes,
dtypes and devices of queries, keys, values, caches, slot and block mappings, and the optional
arguments (window, soft cap, sinks, the latent cache's value dim). Each raises ``ValueError``
naming the argument, the expected form and what it got.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from llm_kernels.attention_metadata import AttentionMetadata
from llm_kernels.kv_quant import is_fp8


def check_attention_options(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """The optional arguments of a paged-attention call; shared by the torch and Triton kernels."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int | np.integer)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if logits_soft_cap is not None and (
        isinstance(logits_soft_cap, bool)
        or not isinstance(logits_soft_cap, int | float | np.number)
        or not math.isfinite(logits_soft_cap)
        or logits_soft_cap <= 0
    ):
        raise ValueError(
            f"logits_soft_cap must be None or a finite float > 0, got {logits_soft_cap!r}"
        )


def check_sinks(sinks: Tensor | None, query: Tensor) -> None:
    """Attention sinks: None, or one floating logit per query head on the query's device;
    shared by the torch and Triton kernels."""
    if sinks is None:
        return
    num_heads = query.shape[1]
    if not isinstance(sinks, Tensor) or sinks.shape != (num_heads,):
        got = list(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise ValueError(
            f"sinks must be None or a tensor of shape [{num_heads}] (num_heads), got {got}"
        )
    if not sinks.is_floating_point():
        raise ValueError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.device != query.device:
        raise ValueError(f"sinks is on {sinks.device} but query is on {query.device}")


def check_cache_write_args(
    key: Tensor, value: Tensor | None, kv_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Shapes, dtypes and devices of a cache write; shared by the torch and Triton kernels. A
    one-plane (latent) cache takes no ``value``, a two-plane cache needs one."""
    check_kv_cache("kv_cache", kv_cache)
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    if (value is None) != (kv_cache.shape[0] == 1):
        raise ValueError(
            "value must be None for a one-plane (latent) kv_cache and a tensor for a K/V one, "
            f"got {'None' if value is None else 'a tensor'} for {kv_cache.shape[0]} plane(s)"
        )
    written = [("key", key)] if value is None else [("key", key), ("value", value)]
    for name, t in written:
        _check_same_device_dtype(name, t, kv_cache, fp8_ok=True)
        if t.dim() != 3 or t.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must have shape [num_tokens, {num_kv_heads}, {head_dim}] to match "
                f"kv_cache, got {list(t.shape)}"
            )
    if value is not None and key.shape != value.shape:
        raise ValueError(f"value has shape {list(value.shape)} but key has {list(key.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping must have shape [{key.shape[0]}] (one slot per key row), "
            f"got {list(slot_mapping.shape)}"
        )
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.device != kv_cache.device:
        raise ValueError(
            f"slot_mapping is on {slot_mapping.device} but kv_cache is on {kv_cache.device}"
        )


def check_attention_args(
    query: Tensor, kv_cache: Tensor, metadata: AttentionMetadata, scale: float
) -> None:
    """Shapes, dtypes and devices of a paged-attention call; shared by the torch and Triton
    kernels (the Triton wrapper adds its own constraints)."""
    check_kv_cache("kv_cache", kv_cache)
    _check_same_device_dtype("query", query, kv_cache, fp8_ok=True)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if query.dim() != 3:
        raise ValueError(
            f"query must have shape [num_tokens, num_heads, head_dim], got {list(query.shape)}"
        )
    num_tokens, num_heads, query_head_dim = query.shape
    if num_tokens != metadata.num_tokens:
        raise ValueError(
            f"query has {num_tokens} tokens but metadata describes {metadata.num_tokens}"
        )
    if query_head_dim != head_dim:
        raise ValueError(f"query has head_dim {query_head_dim} but kv_cache has {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query has {num_heads} heads but kv_cache has {num_kv_heads} kv heads; "
            "num_heads must be a multiple of num_kv_heads"
        )
    if block_size != metadata.block_size:
        raise ValueError(
            f"kv_cache has block_size {block_size} but metadata was built for {metadata.block_size}"
        )
    if metadata.max_block_id >= num_blocks:
        raise ValueError(
            f"metadata.block_table references block {metadata.max_block_id} but kv_cache has "
            f"{num_blocks} blocks"
        )
    if metadata.device != kv_cache.device:
        raise ValueError(f"metadata is on {metadata.device} but kv_cache is on {kv_cache.device}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")


def check_value_dim(kv_cache: Tensor, v_head_dim: int | None) -> int:
    """The values' head dim: the cache's own for a K/V cache (``v_head_dim`` None), or
    ``v_head_dim`` (1 to head_dim) over a one-plane latent cache, which requires it."""
    head_dim = kv_cache.shape[-1]
    if kv_cache.shape[0] == 2:
        if v_head_dim is not None and v_head_dim != head_dim:
            raise ValueError(
                f"v_head_dim is for a one-plane (latent) kv_cache; a K/V cache's values have "
                f"its head_dim {head_dim}, got {v_head_dim}"
            )
        return head_dim
    if (
        isinstance(v_head_dim, bool)
        or not isinstance(v_head_dim, int | np.integer)
        or not 1 <= v_head_dim <= head_dim
    ):
        raise ValueError(
            f"v_head_dim must be an int in [1, {head_dim}] for a one-plane (latent) kv_cache, "
            f"got {v_head_dim!r}"
        )
    return int(v_head_dim)


def check_kv_cache(name: str, kv_cache: Tensor) -> None:
    """A KV cache tensor: [2, num_blocks, block_size, num_kv_heads, head_dim] (K, V) or
    [1, ...] (a latent), float, contiguous."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] not in (1, 2):
        raise ValueError(
            f"{name} must have shape [2, num_blocks, block_size, num_kv_heads, head_dim] "
            f"(or [1, ...] for a latent cache), got {list(kv_cache.shape)}"
        )
    if not kv_cache.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {kv_cache.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous (slots are addressed through a flat view)")


def _check_same_device_dtype(name: str, t: Tensor, kv_cache: Tensor, fp8_ok: bool = False) -> None:
    """Same dtype as the cache, or (``fp8_ok``) any compute dtype over an FP8 cache."""
    if fp8_ok and is_fp8(kv_cache):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"{name} must be float16, bfloat16 or float32 over an fp8 kv_cache, got {t.dtype}"
            )
    elif t.dtype != kv_cache.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but kv_cache has {kv_cache.dtype}")
    if t.device != kv_cache.device:
        raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")


def check_block_mapping(block_mapping: Tensor) -> None:
    """A [K, 2] int64 tensor of (src, dst) block ids, as copy_blocks and swap_blocks take."""
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(
            f"block_mapping must have shape [K, 2] of (src, dst), got {list(block_mapping.shape)}"
        )
    if block_mapping.dtype != torch.int64:
        raise ValueError(f"block_mapping must be int64, got {block_mapping.dtype}")


def id_range(block_ids: Tensor) -> tuple[int, int] | None:
    # An out-of-range id would be a device-side assert on GPU; one tiny host sync per call is
    # cheaper to debug, and these copies run once per step, not per layer.
    if block_ids.numel() == 0:
        return None
    return int(block_ids.min()), int(block_ids.max())


def check_block_range(
    name: str, id_range: tuple[int, int] | None, num_blocks: int, cache_name: str
) -> None:
    if id_range is not None and (id_range[0] < 0 or id_range[1] >= num_blocks):
        raise ValueError(
            f"{name} must be in [0, {num_blocks}) for {cache_name}, "
            f"got values in [{id_range[0]}, {id_range[1]}]"
        )
