"""Batched multi-LoRA deltas in Triton (the CUDA path); ``llm_kernels.lora`` holds the torch
reference with the same contract.

One program per token (and per output tile for the expand), reading its adapter slot from
``token_slots`` (BGMV-style): tokens with slot -1 load nothing and store nothing, so a batch of
base-model and adapter requests needs no regrouping. The shrink keeps v = A x in float32 for
the expand; the delta is added to y in y's dtype.

    shrink  grid (T,)                      v[t, :R]  = A[slot_t] @ x[t]
    expand  grid (T, cdiv(out, BLOCK_N))   y[t, n:n+BLOCK_N] += B[slot_t, n:n+BLOCK_N] @ v[t]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from llm_kernels.lora import LoRAMapping
from llm_kernels.triton_common import check_triton_device

__all__ = ["add_lora", "lora_expand", "lora_shrink"]

_BLOCK_K = 64
_BLOCK_N = 64


@triton.jit
def _lora_shrink_kernel(
    v_ptr,
    x_ptr,
    a_ptr,
    slots_ptr,
    stride_x,
    stride_a_slot,
    stride_a_rank,
    stride_v,
    in_features,
    rank,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    # A token without an adapter reads nothing (its features count as 0) and stores zeros.
    in_features = tl.where(slot >= 0, in_features, 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    rank_mask = offs_r < rank
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_features
        x = tl.load(x_ptr + token * stride_x + offs_k, mask=k_mask, other=0.0)
        a = tl.load(
            a_ptr + slot * stride_a_slot + offs_r[:, None] * stride_a_rank + offs_k[None, :],
            mask=rank_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(v_ptr + token * stride_v + offs_r, acc, mask=rank_mask)


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    v_ptr,
    b_ptr,
    slots_ptr,
    stride_y,
    stride_v,
    stride_b_slot,
    stride_b_out,
    out_features,
    rank,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    # A token without an adapter has nothing to add: no output column is touched.
    out_features = tl.where(slot >= 0, out_features, 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < out_features
    r_mask = offs_r < rank
    v = tl.load(v_ptr + token * stride_v + offs_r, mask=r_mask, other=0.0)
    b = tl.load(
        b_ptr + slot * stride_b_slot + offs_n[:, None] * stride_b_out + offs_r[None, :],
        mask=n_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    delta = tl.sum(b.to(tl.float32) * v.to(tl.float32)[None, :], axis=1)
    y = tl.load(y_ptr + token * stride_y + offs_n, mask=n_mask, other=0.0)
    tl.store(y_ptr + token * stride_y + offs_n, (y.to(tl.float32) + delta).to(y.dtype), mask=n_mask)


def _check(name: str, x: Tensor, weights: Tensor, mapping: LoRAMapping) -> None:
    check_triton_device(x.device, name)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be a [tokens, features] tensor with unit stride")
    if weights.dim() != 3 or weights.stride(2) != 1:
        raise ValueError("LoRA weights must be [slots, rows, cols] tensors with unit last stride")
    if mapping.token_slots.shape[0] != x.shape[0]:
        raise ValueError(
            f"token_slots has {mapping.token_slots.shape[0]} entries for {x.shape[0]} tokens"
        )


def lora_shrink(x: Tensor, lora_a: Tensor, mapping: LoRAMapping) -> Tensor:
    """v [T, R] float32 with v_t = A[slot_t] x_t (zero rows for slot -1)."""
    _check("x", x, lora_a, mapping)
    rank = lora_a.shape[1]
    v = torch.zeros(x.shape[0], rank, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0 or not mapping.has_lora:
        return v
    _lora_shrink_kernel[(x.shape[0],)](
        v,
        x,
        lora_a,
        mapping.token_slots,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        v.stride(0),
        x.shape[1],
        rank,
        BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_K=_BLOCK_K,
    )
    return v


def lora_expand(y: Tensor, v: Tensor, lora_b: Tensor, mapping: LoRAMapping) -> None:
    """In place: y_t += B[slot_t] v_t for tokens with an adapter."""
    _check("y", y, lora_b, mapping)
    if y.shape[0] == 0 or not mapping.has_lora:
        return
    rank, out_features = lora_b.shape[2], lora_b.shape[1]
    grid = (y.shape[0], triton.cdiv(out_features, _BLOCK_N))
    _lora_expand_kernel[grid](
        y,
        v,
        lora_b,
        mapping.token_slots,
        y.stride(0),
        v.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        out_features,
        rank,
        BLOCK_N=_BLOCK_N,
        BLOCK_R=triton.next_power_of_2(rank),
    )


def add_lora(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, mapping: LoRAMapping) -> None:
    """In place: y_t += B[slot_t] (A[slot_t] x_t)."""
    if not mapping.has_lora:
        return
    lora_expand(y, lora_shrink(x, lora_a, mapping), lora_b, mapping)
