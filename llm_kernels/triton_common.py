"""Triton pieces the kernel modules share: where a kernel may run (CUDA tensors, or CPU tensors
under the Triton interpreter), and the paged-attention building blocks that the attention kernel
(``llm_kernels.triton_attention``) and the latent one (``llm_kernels.triton_mla``) both use:
the search for a program's request, dots and K/V tile loads, the split-KV merge and the split
count."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llm_kernels.attention_metadata import AttentionMetadata
from llm_kernels.kv_quant import FP8_DTYPE
from llm_kernels.triton_fp8 import fp8e4m3_bits_to_float

__all__ = [
    "ATTENTION_DTYPES",
    "LOG2E",
    "MAX_KV_SPLITS",
    "check_triton_device",
    "choose_num_kv_splits",
    "dot",
    "find_seq",
    "interpreter_enabled",
    "load_kv",
    "merge_splits_kernel",
]

LOG2E = 1.4426950408889634
# Split-KV only pays when the grid would otherwise leave SMs idle and each split still has
# a few hundred keys to amortize its partial write.
_SPLIT_TARGET_PROGRAMS = 256
_SPLIT_MIN_KEYS = 256
MAX_KV_SPLITS = 64
ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8_DTYPE)


@triton.jit
def find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The request whose tiles include program ``pid``: the largest ``b`` with
    ``query_start_loc[b] // BLOCK_Q + b <= pid``."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # Under the Triton interpreter, bf16 operands are upcast to float32 first: the interpreter
    # (numpy has no bfloat16) computes bf16 dots wrongly in triton 3.9, and bf16 values are
    # exact in float32. The interpreter also truncates float32 -> bf16 casts where the GPU
    # rounds to nearest, so bf16 results differ from the GPU's by up to one unit in the last
    # place.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def load_kv(ptr, mask, scale, dtype, KV_FP8: tl.constexpr):
    """A K or V tile in the compute ``dtype``; an FP8 cache (bytes) is dequantized as
    ``llm_kernels.kv_quant.dequantize_kv`` does: float32(q) * scale, cast to ``dtype``."""
    # One return: the compiler types every return of a function, taken or not.
    if KV_FP8:
        tile = (fp8e4m3_bits_to_float(tl.load(ptr, mask=mask, other=0)) * scale).to(dtype)
    else:
        tile = tl.load(ptr, mask=mask, other=0.0)
    return tile


@triton.jit
def merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    num_heads,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    row = (token * num_heads + head) * NUM_SPLITS
    lse = tl.load(partial_lse_ptr + row + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.math.exp2(lse - lse_max)
    o = tl.load(
        partial_out_ptr + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=(offs_s < NUM_SPLITS)[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    merged = tl.sum(o * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + offs_d,
        merged.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def choose_num_kv_splits(
    metadata: AttentionMetadata, num_kv_heads: int, sliding_window: int | None = None
) -> int:
    """How many key ranges each decode tile is cut into: 1 for batches with a prefill chunk
    or enough (request, kv head) pairs to fill the GPU, more for a few long decodes (long in
    keys read: a windowed decode reads at most ``sliding_window``).

    Depends only on host integers of the metadata, so a CUDA graph captured with
    ``max_seq_len = max_model_len`` keeps a choice valid for every later length.
    """
    if metadata.max_query_len != 1:
        return 1
    programs = max(metadata.num_seqs * num_kv_heads, 1)
    if programs >= _SPLIT_TARGET_PROGRAMS:
        return 1
    max_keys = metadata.max_seq_len
    if sliding_window is not None:
        max_keys = min(max_keys, sliding_window)
    by_length = max(max_keys // _SPLIT_MIN_KEYS, 1)
    return min(math.ceil(_SPLIT_TARGET_PROGRAMS / programs), by_length, MAX_KV_SPLITS)


def check_triton_device(device: torch.device, name: str) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreter_enabled():
        return
    raise ValueError(
        f"{name} is on {device}: Triton kernels need CUDA tensors, or CPU tensors with "
        "TRITON_INTERPRET=1 set before kernels.triton_* is first imported"
    )


def interpreter_enabled() -> bool:
    """Whether this process's kernels were decorated for the Triton interpreter (decided by
    TRITON_INTERPRET when the kernel modules were imported, not by its value now)."""
    return type(merge_splits_kernel).__name__ == "InterpretedFunction"
