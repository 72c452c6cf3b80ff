"""Fused mixture-of-experts over MXFP4 experts in Triton (gpt-oss on CUDA): the weights stay in
the checkpoint's layout (``llm_kernels.moe_inputs.Mxfp4Experts``) and are dequantized tile by tile
inside the GEMMs; ``llm_kernels.moe.fused_moe_mxfp4`` picks this or the torch path.

The pairs are sorted by expert and padded to BLOCK_M runs as for the dense kernel
(``llm_kernels.triton_moe.moe_align_block_size``); then two launches of ``_mxfp4_moe_gemm_kernel``:

1. ``act[p] = swiglu(W13[e] x[p // top_k] + b13[e])``: the output tile's BLOCK_N interleaved
   columns are BLOCK_N / 2 (gate, up) pairs, so the clamped SwiGLU runs in the epilogue, in
   float32, and the tile stores BLOCK_N / 2 activations (``act`` is ``[pairs, I]``).
2. ``down[p] = w[p] * (W2[e] act[p] + b2[e])`` in float32, summed over top-k by torch.

A weight tile ``[BLOCK_K, BLOCK_N]`` is read from its bytes: value k of row n is nibble
``k % 2`` (low first) of byte ``k // 2`` of the row, times the row's scale ``k // 32``; both
built from bits (E2M1: sign, 2-bit exponent, 1-bit mantissa; E8M0: ``s << 23``), so each
weight is exact in float32, and in bfloat16 for the tensor-core dot when x is bfloat16. w2's
inputs start ``w2_offset`` values into a row (a TP rank's slice of the intermediate dim need not
start on a group). Under the interpreter, low-precision dots are upcast to float32 as in
``llm_kernels.triton_moe``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from llm_kernels.moe_inputs import Mxfp4Experts, check_moe_inputs, local_expert_ids
from llm_kernels.triton_common import check_triton_device, interpreter_enabled
from llm_kernels.triton_moe import MoeAlignment, moe_align_block_size, moe_block_sizes

__all__ = ["fused_moe_mxfp4_triton"]


@triton.jit
def _mxfp4_tile(blocks_row, scales_row, pos, mask):
    """The float32 weights at positions ``pos [BLOCK_K, 1]`` of rows ``*_row [1, BLOCK_N]``."""
    byte = tl.load(blocks_row + pos // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((pos % 2) * 4)) & 0xF
    exponent = (code >> 1) & 0x3
    mantissa = code & 0x1
    # |E2M1|: exponent 0 is 0 or 0.5 (= 2^-1), else (1 + mantissa / 2) * 2^(exponent - 1).
    magnitude = tl.where(
        exponent > 0, ((exponent + 126) << 23) | (mantissa << 22), mantissa * (126 << 23)
    )
    value = (magnitude | ((code & 0x8) << 28)).to(tl.float32, bitcast=True)
    s = tl.load(scales_row + pos // 32, mask=mask, other=127).to(tl.int32)
    scale = tl.where(s > 0, s << 23, 1 << 22).to(tl.float32, bitcast=True)
    return value * scale


@triton.jit
def _mxfp4_moe_gemm_kernel(
    c_ptr,
    a_ptr,
    blocks_ptr,
    scales_ptr,
    bias_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    k_offset,
    num_pairs,
    stride_am,
    stride_cm,
    stride_be,
    stride_bn,
    stride_se,
    stride_sn,
    stride_bias,
    alpha,
    limit,
    PAIRS_PER_A_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """c[p, n] = (w[p] *) (sum_k a[p // PAIRS_PER_A_ROW, k] W[expert(p), n, k] + bias[n]);
    with SWIGLU, c[p, n / 2] = swiglu(gate = column n, up = column n + 1) for even n."""
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
    rows = offs_n[None, :].to(tl.int64)
    blocks_row = blocks_ptr + expert * stride_be + rows * stride_bn
    scales_row = scales_ptr + expert * stride_se + rows * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        pos = (k0 + k_offset + offs_k)[:, None]
        w = _mxfp4_tile(blocks_row, scales_row, pos, k_valid[:, None] & n_valid[None, :])
        if DOT_UPCAST:
            acc += tl.dot(a.to(tl.float32), w, input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_bias + offs_n, mask=n_valid, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pairs, mask=row_valid, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    if SWIGLU:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        offs_out = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_out[None, :]
        mask = row_valid[:, None] & (offs_out < N // 2)[None, :]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
        mask = row_valid[:, None] & n_valid[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def fused_moe_mxfp4_triton(
    x: Tensor,
    experts: Mxfp4Experts,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    alpha: float,
    limit: float,
    expert_map: Tensor | None = None,
    block_m: int | None = None,
) -> Tensor:
    """``llm_kernels.moe.fused_moe_mxfp4``'s contract on the Triton kernels (CUDA tensors, or CPU
    tensors under the interpreter); ``block_m`` overrides ``moe_block_sizes``' BLOCK_M."""
    check_moe_inputs(x, topk_weights, topk_ids)
    experts.check(x)
    check_triton_device(x.device, "x")
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    num_tokens, top_k = topk_ids.shape
    hidden, inter = experts.hidden, experts.intermediate
    if num_tokens == 0:
        return torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = local_expert_ids(topk_ids, expert_map, experts.num_experts)
    num_pairs = ids.numel()
    auto_m, block_n, block_k = moe_block_sizes(num_pairs, experts.num_experts)
    align = moe_align_block_size(ids, experts.num_experts, block_m or auto_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    # Pairs on other ranks are never written by GEMM 1 nor read by GEMM 2.
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _launch(act, x, experts, True, weights, align, top_k, alpha, limit, block_n, block_k)
    down = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _launch(down, act, experts, False, weights, align, 1, alpha, limit, block_n, block_k)
    return down.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _launch(
    c: Tensor,
    a: Tensor,
    experts: Mxfp4Experts,
    first: bool,
    weights: Tensor,
    align: MoeAlignment,
    pairs_per_a_row: int,
    alpha: float,
    limit: float,
    block_n: int,
    block_k: int,
) -> None:
    """GEMM 1 (``first``: w13, bias, SwiGLU) or GEMM 2 (w2, bias, routing weight) into c."""
    if first:
        blocks, scales, bias, k_offset = experts.w13_blocks, experts.w13_scales, experts.w13_bias, 0
    else:
        blocks, scales, bias = experts.w2_blocks, experts.w2_scales, experts.w2_bias
        k_offset = experts.w2_offset
    # Rows may be strided (an EP or TP slice); each row's groups and bytes must be dense.
    if blocks.stride(-1) != 1 or blocks.stride(-2) != blocks.shape[-1]:
        blocks = blocks.contiguous()
    if scales.stride(-1) != 1:
        scales = scales.contiguous()
    n = blocks.shape[1]
    k = a.shape[1]
    grid = (align.block_expert_ids.shape[0], triton.cdiv(n, block_n))
    _mxfp4_moe_gemm_kernel[grid](
        c,
        a,
        blocks,
        scales,
        bias if bias is not None else weights,
        weights,
        align.sorted_pair_ids,
        align.block_expert_ids,
        align.num_tokens_post_padded,
        n,
        k,
        k_offset,
        c.shape[0],
        a.stride(0),
        c.stride(0),
        blocks.stride(0),
        blocks.stride(1),
        scales.stride(0),
        scales.stride(1),
        bias.stride(0) if bias is not None else 0,
        alpha,
        limit,
        PAIRS_PER_A_ROW=pairs_per_a_row,
        HAS_BIAS=bias is not None,
        SWIGLU=first,
        MUL_ROUTED_WEIGHT=not first,
        BLOCK_M=align.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # fp32 activations are meant to match the fp32 reference, so no TF32 rounding.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        DOT_UPCAST=a.dtype != torch.float32 and interpreter_enabled(),
        # Dequantizing a weight tile takes registers of its own: 64-row tiles on 4 warps
        # spill in float32 (sm_90), on 8 they do not (tests/llm_kernels/test_triton_mxfp4_moe.py).
        num_warps=8 if align.block_m >= 64 else 4,
    )
