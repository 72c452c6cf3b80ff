"""Triton GEMMs for quantized weights (called through ``llm_kernels.quant_gemm``, whose torch
references define their numbers):

* ``fp8_block_linear``: FP8 weights with a scale per ``(bn, bk)`` block (DeepSeek-V3 /
  compressed-tensors ``block`` strategy) times FP8 activations with a scale per token and
  ``bk`` columns. A program owns a ``BLOCK_M x BLOCK_N`` output tile and walks K one scale
  block (``bk`` columns) at a time: one FP8 ``tl.dot`` into float32, then both scales applied
  to that partial sum (``acc += dot * s_x[m, kb] * s_w[n // bn, kb]``).
* ``w4a16_gemm``: pack-quantized int4 weights (``int32 [N, K // 8]``, low nibble first,
  stored plus 8) dequantized inside the K loop: each tile of 8-value words is unpacked with
  shifts, offset by 8 and the group's zero point, scaled by the group's scale (float32) and
  cast to the activations' dtype before ``tl.dot``, so the weight is read as 4 bits per value
  and never expanded in memory. ``BLOCK_K`` divides ``group_size`` so that a K tile has one
  scale (and zero point) per output column.

Under the Triton interpreter (CPU tests) FP8 operands are passed as bytes and decoded with
``llm_kernels.triton_fp8`` (the interpreter's float8 conversions are not torch's), and bf16
operands are upcast before ``tl.dot`` (the interpreter computes bf16 dots wrongly); on a GPU
the FP8 dot runs on FP8 tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from llm_kernels.fp8_activations import quantize_activations_fp8
from llm_kernels.triton_fp8 import fp8e4m3_bits_to_float

__all__ = ["block_kernel_supports", "fp8_block_linear", "w4a16_gemm"]


@triton.jit
def _fp8_operand(ptr, mask, NATIVE: tl.constexpr):
    # One return: the compiler types every return of a function, taken or not.
    if NATIVE:
        operand = tl.load(ptr, mask=mask, other=0.0)
    else:
        operand = fp8e4m3_bits_to_float(tl.load(ptr, mask=mask, other=0))
    return operand


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om,
    BN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NATIVE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = _fp8_operand(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            m_valid[:, None] & k_valid[None, :],
            NATIVE,
        )
        b = _fp8_operand(
            w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
            k_valid[:, None] & n_valid[None, :],
            NATIVE,
        )
        if NATIVE:  # noqa: SIM108 (a constexpr branch: only one dot is compiled)
            partial = tl.dot(a, b)
        else:
            partial = tl.dot(a, b, input_precision="ieee")
        a_scale = tl.load(x_scale_ptr + offs_m * stride_xsm + kb, mask=m_valid, other=0.0)
        b_scale = tl.load(w_scale_ptr + (offs_n // BN) * stride_wsn + kb, mask=n_valid, other=0.0)
        acc += partial * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    out_offsets = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(
        out_ptr + out_offsets,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_valid[:, None] & n_valid[None, :],
    )


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=m_valid[:, None] & k_valid[None, :],
            other=0.0,
        )
        # [BLOCK_K, BLOCK_N] words; the 8 rows that share a word load it once from cache.
        words = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (offs_k // 8)[:, None],
            mask=k_valid[:, None] & n_valid[None, :],
            other=0,
        )
        q = ((words >> ((offs_k % 8) * 4)[:, None]) & 0xF) - 8
        group = k0 // GROUP
        if HAS_ZERO:
            zero = tl.load(zero_ptr + offs_n * stride_zn + group, mask=n_valid, other=0)
            q = q - zero.to(tl.int32)[None, :]
        scale = tl.load(scale_ptr + offs_n * stride_sn + group, mask=n_valid, other=0.0)
        w = (q.to(tl.float32) * scale.to(tl.float32)[None, :]).to(a.dtype)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_valid[:, None] & n_valid[None, :],
    )


def block_kernel_supports(block_size: tuple[int, int]) -> bool:
    """The block kernel walks K one scale block per step, so bk must be a power of two >= 16
    (tl.dot's minimum); other block sizes take the torch reference."""
    bk = block_size[1]
    return bk >= 16 and bk & (bk - 1) == 0


def fp8_block_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    block_size: tuple[int, int],
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """``x [M, K]`` (float) times block-scaled FP8 ``weight [N, K]``; ``[M, N]`` in
    ``out_dtype``. Activations are quantized per token and ``bk`` columns first."""
    bn, bk = block_size
    if not block_kernel_supports(block_size):
        raise ValueError(f"block_size: bk must be a power of two >= 16, got {bk}")
    x_q, x_scale = quantize_activations_fp8(x, None, bk)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    native = not _interpreted()
    w_scale = weight_scale.to(torch.float32).contiguous()
    weight = weight.contiguous()
    block_m = 16 if m <= 16 else 64
    block_n = 128 if native else 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_gemm_kernel[grid](
        x_q if native else x_q.view(torch.uint8),
        x_scale,
        weight if native else weight.view(torch.uint8),
        w_scale,
        bias if bias is not None else out,
        out,
        m, n, k,
        x_q.stride(0), x_scale.stride(0), weight.stride(0), w_scale.stride(0), out.stride(0),
        BN=bn,
        BLOCK_K=bk,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_BIAS=bias is not None,
        NATIVE=native,
        num_warps=4,
        num_stages=3 if native else 1,
    )  # fmt: skip
    return out


def w4a16_gemm(
    x: Tensor,
    weight_packed: Tensor,
    weight_scale: Tensor,
    weight_zero_point: Tensor | None,
    group_size: int,
    bias: Tensor | None,
) -> Tensor:
    """``x [M, K]`` times the dequantized int4 weight ``[N, K]``; ``[M, N]`` in x's dtype."""
    x = x.contiguous()
    m, k = x.shape
    n = weight_packed.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    # A K tile must sit inside one group: the largest power of two <= 64 dividing the group
    # (8 at least, a whole packed word).
    block_k = 64
    while group_size % block_k:
        block_k //= 2
    if block_k < 16 or k % 8:
        raise ValueError(
            f"group_size: must be a multiple of 16 and K of 8 for the W4A16 kernel, got "
            f"group_size {group_size}, K {k}"
        )
    block_m = 16 if m <= 16 else 64
    block_n = 64
    scale = weight_scale.contiguous()
    zero = weight_zero_point.contiguous() if weight_zero_point is not None else scale
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_gemm_kernel[grid](
        x, weight_packed.contiguous(), scale, zero,
        bias if bias is not None else out, out,
        m, n, k,
        x.stride(0), weight_packed.stride(0), scale.stride(0), zero.stride(0), out.stride(0),
        GROUP=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HAS_ZERO=weight_zero_point is not None,
        HAS_BIAS=bias is not None,
        UPCAST=_interpreted() and x.dtype == torch.bfloat16,
        num_warps=4,
        num_stages=3,
    )  # fmt: skip
    return out


def _interpreted() -> bool:
    """Whether this module's kernels were decorated for the Triton interpreter."""
    return type(_w4a16_gemm_kernel).__name__ == "InterpretedFunction"
