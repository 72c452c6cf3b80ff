"""Fused mixture-of-experts in Triton (the CUDA path); ``llm_kernels.moe`` holds the torch path and
``fused_moe``, which picks between them. Same contract, notation from llm_kernels/moe.py: a *pair*
is one (token, k) routing choice, numbered ``p = t * top_k + k``.

1. ``moe_align_block_size`` (torch ops, no host sync): sort the pairs by expert and pad each
   expert's run to a multiple of BLOCK_M with the sentinel ``num_pairs``, so every BLOCK_M
   block of ``sorted_pair_ids`` belongs to one expert (``MoeAlignment``)::

       sorted_pair_ids  | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e5 -- -- -- | -- ... (spare)
       block_expert_ids |     0       |      2      |      2      |      5      |  E  ...
                        '---------------- num_tokens_post_padded ---------------'

2. ``_moe_gemm_kernel`` over grid (blocks, cdiv(N, BLOCK_N)): one program takes one expert's
   BLOCK_M pairs and one BLOCK_N tile of the output (GEMM 1 with w1).
3. SiLU(gate) * up on the ``[pairs, 2I]`` GEMM-1 output (``llm_kernels.triton_ops.silu_and_mul``).
4. GEMM 2 with w2 and the routing weights, into float32 ``[pairs, H]``; a torch sum over K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from llm_kernels.moe_inputs import check_moe_args, local_expert_ids
from llm_kernels.triton_common import check_triton_device, interpreter_enabled
from llm_kernels.triton_ops import silu_and_mul

__all__ = ["MoeAlignment", "fused_moe_triton", "moe_align_block_size", "moe_block_sizes"]


@triton.jit
def _moe_gemm_kernel(
    c_ptr,
    a_ptr,
    b_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    num_pairs,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    PAIRS_PER_A_ROW: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """c[p, n] = (w[p] *) sum_k a[p // PAIRS_PER_A_ROW, k] * b[expert(p), n, k].

    One program takes one expert's BLOCK_M pairs and one BLOCK_N tile of the output, gathers
    the pairs' input rows (row ``p // top_k`` of x in the first GEMM, row ``p`` of the
    activations in the second), loops over K in BLOCK_K steps accumulating in float32,
    optionally scales each row by its routing weight, and scatters the tile to rows ``p`` of
    the output. Sentinel rows load and store nothing. Under the Triton interpreter (DOT_UPCAST)
    bf16/fp16 ``tl.dot`` operands are upcast to float32 first, as in llm_kernels/triton_attention.py
    (the interpreter's low-precision dots are wrong in triton 3.9).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + offs_m)
    row_valid = pairs < num_pairs
    pairs = tl.where(row_valid, pairs, 0).to(tl.int64)
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // PAIRS_PER_A_ROW)[:, None] * stride_am + offs_k[None, :]
    # b is [N, K] with unit K stride, read as a [BLOCK_K, BLOCK_N] tile (b transposed).
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        if DOT_UPCAST:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pairs, mask=row_valid, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])


@dataclass(frozen=True)
class MoeAlignment:
    """Pairs sorted by expert, each expert's run padded to a multiple of ``block_m``.

    ``sorted_pair_ids [capacity]`` int32: pair ids, ``num_pairs`` where padding;
    ``block_expert_ids [capacity // block_m]`` int32: the expert of each block (``E`` for the
    spare blocks past the end); ``num_tokens_post_padded [1]`` int32: the padded length used.

    ``sorted_pair_ids`` has room for the worst case, ``num_pairs + E * (BLOCK_M - 1)`` rounded
    up to BLOCK_M, so its size and the grid depend on shapes only; programs whose block starts
    at or past ``num_tokens_post_padded`` return at once. Experts with no pairs get no block.
    """

    sorted_pair_ids: Tensor
    block_expert_ids: Tensor
    num_tokens_post_padded: Tensor
    block_m: int


def moe_align_block_size(expert_ids: Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Sort the pairs of ``expert_ids`` (``[T, K]`` or flat, local ids, negative = not on this
    rank) by expert and pad each expert's run to a multiple of ``block_m``; no host sync."""
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    device = expert_ids.device
    ids = expert_ids.reshape(-1).to(torch.int64)
    num_pairs = ids.numel()
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    # Pairs for other ranks count in bin E, which gets no blocks; they sort after all experts.
    ids = torch.where(ids < 0, num_experts, ids)
    # scatter_add, not bincount: CUDA's bincount reads the max id back to the host.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    rank_in_run = torch.arange(num_pairs, device=device) - run_start[sorted_ids]
    padded_start = torch.cat([padded_end.new_zeros(1), padded_end])  # bin E starts at the end
    dest = padded_start[sorted_ids] + rank_in_run
    # Pairs for other ranks all land on one spare slot past `capacity`, then cut off.
    dest = torch.where(sorted_ids < num_experts, dest, capacity)
    sorted_pair_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    return MoeAlignment(
        sorted_pair_ids=sorted_pair_ids[:capacity],
        block_expert_ids=block_expert_ids.to(torch.int32),
        num_tokens_post_padded=padded_end[-1:].to(torch.int32),
        block_m=block_m,
    )


def moe_block_sizes(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): BLOCK_M follows the mean pairs per expert, so decode
    (a few pairs per expert) pads little and prefill fills tensor-core tiles."""
    mean_pairs = num_pairs / num_experts
    block_m = 16 if mean_pairs <= 16 else 32 if mean_pairs <= 64 else 64
    return block_m, 64, 32 if block_m == 64 else 64


def fused_moe_triton(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    expert_map: Tensor | None = None,
    block_m: int | None = None,
) -> Tensor:
    """``llm_kernels.moe.fused_moe``'s contract on the Triton kernels (CUDA tensors, or CPU tensors
    under the interpreter). ``block_m`` (16, 32, 64, ...) overrides the size picked by
    ``moe_block_sizes``; the output is ``[T, H]`` in x's dtype."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    check_triton_device(x.device, "x")
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, intermediate = w2.shape
    if num_tokens == 0:
        return torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    # The kernel takes any row and expert strides; only the reduced (last) dim must be dense,
    # so a TP slice w2[:, :, shard] is used in place.
    x, w13, w2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, w13, w2))
    ids = local_expert_ids(topk_ids, expert_map, num_experts)
    num_pairs = ids.numel()
    auto_m, block_n, block_k = moe_block_sizes(num_pairs, num_experts)
    align = moe_align_block_size(ids, num_experts, block_m or auto_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    # Pairs on other ranks are never written by GEMM 1: zeros keep the activation finite.
    alloc = torch.empty if expert_map is None else torch.zeros
    gate_up = alloc(num_pairs, 2 * intermediate, dtype=x.dtype, device=x.device)
    _launch_gemm(gate_up, x, w13, weights, align, top_k, False, block_n, block_k)
    activated = silu_and_mul(gate_up)
    down = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _launch_gemm(down, activated, w2, weights, align, 1, True, block_n, block_k)
    return down.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _launch_gemm(
    c: Tensor,
    a: Tensor,
    b: Tensor,
    weights: Tensor,
    align: MoeAlignment,
    pairs_per_a_row: int,
    mul_routed_weight: bool,
    block_n: int,
    block_k: int,
) -> None:
    """c[p] = (weights[p] *) b[expert(p)] @ a[p // pairs_per_a_row] for the aligned pairs."""
    n, k = b.shape[1], b.shape[2]
    grid = (align.block_expert_ids.shape[0], triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        c,
        a,
        b,
        weights,
        align.sorted_pair_ids,
        align.block_expert_ids,
        align.num_tokens_post_padded,
        n,
        k,
        c.shape[0],
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        PAIRS_PER_A_ROW=pairs_per_a_row,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        BLOCK_M=align.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # fp32 weights are meant to match the fp32 reference, so no TF32 rounding.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        DOT_UPCAST=a.dtype != torch.float32 and interpreter_enabled(),
        num_warps=4,
    )
