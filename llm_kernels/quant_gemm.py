"""Quantized linear layers' GEMMs: FP8 W8A8 and 4-bit weight-only (W4A16).

``fp8_linear``: weight ``float8_e4m3fn [N, K]`` with a scale per tensor, per output channel
or per ``block_size = (bn, bk)`` block; activations quantized to FP8 per token (dynamic, the
default), per token and ``bk``-group of K (block scales), or with a static per-tensor
``input_scale``. Which implementation runs:

    CUDA, capability >= 8.9   per-tensor / per-channel: torch._scaled_mm (cuBLASLt FP8, tensor-
                              or rowwise scales) when K and N are multiples of 16 and the
                              device accepts the scaling (probed once); block scales: the
                              Triton llm_kernels.triton_quant_gemm (both scales per K block)
    anywhere else             the torch reference (also a shape _scaled_mm refuses, a block bk
                              that is not a power of two >= 16, and for W4A16 a group size
                              that is not a multiple of 16: the Triton tiles need those)

``w4a16_linear``: compressed-tensors' pack-quantized int4 (8 values per int32 along K, low
nibble first, each stored as ``q + 8``), a scale per output channel and ``group_size`` inputs,
optional zero points (asymmetric); the Triton kernel dequantizes in its K loop on CUDA, the
torch reference unpacks and runs a dense matmul elsewhere. The torch references
(``fp8_linear_reference``, ``w4a16_linear_reference``) define the numbers; the CUDA paths
differ from them only by summation order.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from llm_kernels.fp8_activations import expand_columns, quantize_activations_fp8
from llm_kernels.kv_quant import FP8_DTYPE

__all__ = [
    "fp8_linear",
    "fp8_linear_reference",
    "pack_int4",
    "unpack_int4",
    "w4a16_linear",
    "w4a16_linear_reference",
]

# ---- FP8 ---------------------------------------------------------------------------------------


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    block_size: tuple[int, int] | None = None,
    input_scale: Tensor | None = None,
    bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``x [..., K] @ dequant(weight [N, K]).T + bias`` with FP8 activations; returns
    ``[..., N]`` in ``out_dtype`` (default ``x.dtype``). ``weight_scale``: one value, ``[N]``
    / ``[N, 1]`` per output channel, or ``[ceil(N / bn), ceil(K / bk)]`` with ``block_size =
    (bn, bk)``. ``input_scale``: a static per-tensor activation scale, None for dynamic."""
    mode = _check_fp8_args(x, weight, weight_scale, block_size, input_scale, bias)
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    if x2.is_cuda and _fp8_gemm_supported(x2.device):
        if mode == "block":
            from llm_kernels import triton_quant_gemm

            if triton_quant_gemm.block_kernel_supports(block_size):
                out = triton_quant_gemm.fp8_block_linear(
                    x2, weight, weight_scale, block_size, bias, out_dtype
                )
                return out.view(*x.shape[:-1], weight.shape[0])
        tensorwise = mode == "tensor" and input_scale is not None
        if _scaled_mm_fits(x2, weight) and _scaled_mm_accepts(x2.device, out_dtype, tensorwise):
            out = _fp8_scaled_mm(x2, weight, weight_scale, input_scale, bias, out_dtype, tensorwise)
            return out.view(*x.shape[:-1], weight.shape[0])
    return fp8_linear_reference(x, weight, weight_scale, block_size, input_scale, bias, out_dtype)


def fp8_linear_reference(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    block_size: tuple[int, int] | None = None,
    input_scale: Tensor | None = None,
    bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``fp8_linear`` in plain torch on any device: quantize the activations as the GPU path
    does, dequantize both operands to float32 and multiply. These are the numbers:
    ``x_q = saturate(x / s_x)`` rounded to e4m3 (s_x = max|x| / 448 per token or token group,
    or the static scale), then ``(x_q * s_x) @ (w * s_w).T`` in float32, bias added, cast to
    ``out_dtype``; the CUDA paths compute the same sum with FP8 products accumulated in
    float32, so they differ only by summation order."""
    mode = _check_fp8_args(x, weight, weight_scale, block_size, input_scale, bias)
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    group = block_size[1] if mode == "block" else None
    x_q, x_scale = quantize_activations_fp8(x2, input_scale, group)
    x_dq = expand_columns(x_scale, group, x2.shape[1]) * x_q.to(torch.float32)
    w_dq = weight.to(torch.float32) * _weight_scale_grid(weight_scale, weight.shape, block_size)
    out = x_dq @ w_dq.T
    if bias is not None:
        out += bias.to(torch.float32)
    return out.to(out_dtype).view(*x.shape[:-1], weight.shape[0])


def _weight_scale_grid(scale: Tensor, shape: torch.Size, block_size: tuple[int, int] | None):
    """The weight scale broadcastable to ``[N, K]`` in float32."""
    n, k = shape
    scale = scale.to(torch.float32)
    if block_size is not None:
        bn, bk = block_size
        return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    return scale.reshape(n, 1)


def _fp8_scaled_mm(x, weight, weight_scale, input_scale, bias, out_dtype, tensorwise):
    """Per-tensor / per-channel through torch._scaled_mm: tensorwise when both scales are
    single values (a static input scale with a per-tensor weight), rowwise otherwise (scale_a
    [M, 1], scale_b [1, N], fp32, contiguous: torch's rule for rowwise scaling)."""
    x_q, x_scale = quantize_activations_fp8(x, input_scale)
    w_scale = weight_scale.to(torch.float32)
    if tensorwise:
        scale_a, scale_b = x_scale.reshape(()), w_scale.reshape(())
    else:
        scale_a = x_scale.expand(x.shape[0], 1).contiguous()
        scale_b = w_scale.reshape(1, -1).expand(1, weight.shape[0]).contiguous()
    # weight [N, K] row-major is the column-major [K, N] operand _scaled_mm wants.
    out = torch._scaled_mm(x_q, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    if bias is not None:
        out += bias.to(out.dtype)
    return out


def _scaled_mm_fits(x: Tensor, weight: Tensor) -> bool:
    n, k = weight.shape
    return k % 16 == 0 and n % 16 == 0 and weight.is_contiguous() and x.shape[0] > 0


@functools.cache
def _fp8_gemm_supported(device: torch.device) -> bool:
    """FP8 tensor cores: Ada (8.9) and Hopper (9.0) on."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _scaled_mm_accepts(device: torch.device, out_dtype: torch.dtype, tensorwise: bool) -> bool:
    """Whether this device's _scaled_mm takes tensorwise (or rowwise) scales with this output
    dtype: cuBLASLt's support differs by architecture and torch build (rowwise wanted sm_90
    and a bf16 output in some releases), so it is tried once on a 16x16 problem; a refusal
    sends such calls to the reference path."""
    a = torch.zeros(16, 16, dtype=FP8_DTYPE, device=device)
    if tensorwise:
        scale_a = scale_b = torch.ones((), dtype=torch.float32, device=device)
    else:
        scale_a = torch.ones(16, 1, dtype=torch.float32, device=device)
        scale_b = torch.ones(1, 16, dtype=torch.float32, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    except (RuntimeError, ValueError):
        return False
    return True


def _check_fp8_args(x, weight, weight_scale, block_size, input_scale, bias) -> str:
    """The scale layout ("tensor", "channel" or "block"), or a ValueError naming the argument."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(
            f"weight: must be a 2-D float8_e4m3fn [N, K], got {weight.dtype} {list(weight.shape)}"
        )
    n, k = weight.shape
    if not x.is_floating_point() or x.shape[-1] != k:
        raise ValueError(f"x: must be floating point [..., {k}], got {x.dtype} {list(x.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias: must have shape [{n}], got {list(bias.shape)}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"input_scale: must be one value, got shape {list(input_scale.shape)}")
    if block_size is not None:
        if len(block_size) != 2 or not all(isinstance(b, int) and b > 0 for b in block_size):
            raise ValueError(f"block_size: must be two positive ints (bn, bk), got {block_size!r}")
        expected = (math.ceil(n / block_size[0]), math.ceil(k / block_size[1]))
        if tuple(weight_scale.shape) != expected:
            raise ValueError(
                f"weight_scale: must have shape {list(expected)} for block_size "
                f"{tuple(block_size)}, got {list(weight_scale.shape)}"
            )
        if input_scale is not None:
            raise ValueError(
                "input_scale: must be None with block scales (activations are quantized per "
                "token and K block)"
            )
        return "block"
    if weight_scale.numel() == 1:
        return "tensor"
    if tuple(weight_scale.shape) in ((n,), (n, 1)):
        return "channel"
    raise ValueError(
        f"weight_scale: must be one value, [{n}] or [{n}, 1] (or a block grid with "
        f"block_size), got {list(weight_scale.shape)}"
    )


# ---- W4A16 -------------------------------------------------------------------------------------


def w4a16_linear(
    x: Tensor,
    weight_packed: Tensor,
    weight_scale: Tensor,
    weight_zero_point: Tensor | None,
    group_size: int,
    bias: Tensor | None = None,
) -> Tensor:
    """``x [..., K] @ dequant(weight).T + bias`` for pack-quantized int4 weights
    ``int32 [N, K // 8]``, ``weight_scale [N, ceil(K / group_size)]`` and optional unpacked
    ``weight_zero_point`` of the same shape; returns ``[..., N]`` in ``x.dtype``."""
    _check_w4a16_args(x, weight_packed, weight_scale, weight_zero_point, group_size, bias)
    if x.is_cuda and group_size % 16 == 0 and x.shape[-1] % 8 == 0:
        from llm_kernels import triton_quant_gemm

        x2 = x.reshape(-1, x.shape[-1])
        out = triton_quant_gemm.w4a16_gemm(
            x2, weight_packed, weight_scale, weight_zero_point, group_size, bias
        )
        return out.view(*x.shape[:-1], weight_packed.shape[0])
    return w4a16_linear_reference(
        x, weight_packed, weight_scale, weight_zero_point, group_size, bias
    )


def w4a16_linear_reference(
    x: Tensor,
    weight_packed: Tensor,
    weight_scale: Tensor,
    weight_zero_point: Tensor | None,
    group_size: int,
    bias: Tensor | None = None,
) -> Tensor:
    """``w4a16_linear`` in plain torch: unpack, dequantize to x's dtype, dense matmul. These
    are the numbers: ``w = ((q - 8) - zero_point) * scale`` in float32, cast to x's dtype, then
    ``x @ w.T`` (+ bias)."""
    _check_w4a16_args(x, weight_packed, weight_scale, weight_zero_point, group_size, bias)
    k = x.shape[-1]
    w = dequantize_int4(weight_packed, weight_scale, weight_zero_point, group_size, k)
    out = torch.nn.functional.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return out


def dequantize_int4(
    weight_packed: Tensor,
    weight_scale: Tensor,
    weight_zero_point: Tensor | None,
    group_size: int,
    k: int,
) -> Tensor:
    """float32 ``[N, K]``: ``((q - 8) - zero_point) * scale`` per group of ``group_size``."""
    q = unpack_int4(weight_packed, k).to(torch.float32)
    if weight_zero_point is not None:
        q -= weight_zero_point.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :k]
    return q * weight_scale.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :k]


def unpack_int4(weight_packed: Tensor, k: int) -> Tensor:
    """int8 ``[N, k]`` in [-8, 7] from compressed-tensors' int32 ``[N, ceil(k / 8)]``:
    value ``j`` of a word is bits ``4j .. 4j + 3`` (low nibble first), stored plus 8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=weight_packed.device)
    nibbles = (weight_packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.reshape(weight_packed.shape[0], -1)[:, :k] - 8).to(torch.int8)


def pack_int4(q: Tensor) -> Tensor:
    """Inverse of ``unpack_int4``: int values in [-8, 7] ``[N, K]`` (K a multiple of 8) to
    int32 ``[N, K // 8]``."""
    if q.shape[-1] % 8 or int(q.min()) < -8 or int(q.max()) > 7:
        raise ValueError("q: must hold values in [-8, 7] with K a multiple of 8")
    nibbles = (q.to(torch.int64) + 8).reshape(q.shape[0], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (nibbles << shifts).sum(dim=-1)
    # Two's complement: words >= 2**31 are negative int32s.
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _check_w4a16_args(x, weight_packed, weight_scale, weight_zero_point, group_size, bias) -> None:
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise ValueError(
            f"weight_packed: must be int32 [N, K // 8], got {weight_packed.dtype} "
            f"{list(weight_packed.shape)}"
        )
    n = weight_packed.shape[0]
    k = x.shape[-1]
    if not x.is_floating_point() or weight_packed.shape[1] != math.ceil(k / 8):
        raise ValueError(
            f"x: must be floating point [..., K] with K // 8 = {weight_packed.shape[1]} "
            f"(weight_packed's columns), got {x.dtype} {list(x.shape)}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size: must be a positive int, got {group_size!r}")
    groups = math.ceil(k / group_size)
    if tuple(weight_scale.shape) != (n, groups):
        raise ValueError(
            f"weight_scale: must have shape [{n}, {groups}], got {list(weight_scale.shape)}"
        )
    if weight_zero_point is not None and tuple(weight_zero_point.shape) != (n, groups):
        raise ValueError(
            f"weight_zero_point: must have shape [{n}, {groups}] (unpacked), got "
            f"{list(weight_zero_point.shape)}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias: must have shape [{n}], got {list(bias.shape)}")
