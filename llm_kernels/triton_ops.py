"""Fused pointwise model ops in Triton: RMSNorm (+ residual add), rotary embedding,
SiLU-and-mul, GELU-tanh-and-mul. Each replaces several torch kernels (and their intermediate
tensors) by one pass over memory; ``llm_kernels.ops`` holds the torch versions they must match.

Rounding follows the torch reference: the residual sum is rounded to the input dtype before
it is normalized, the normalized value is rounded before the weight multiply, silu(gate) and
gelu(gate) are rounded before the multiply by ``up``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from llm_kernels.triton_common import check_triton_device

__all__ = ["gelu_tanh_and_mul", "rms_norm", "rotary_embedding", "silu_and_mul"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ACT_BLOCK = 1024
_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    stride_x,
    stride_residual,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * hidden + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    normed = (x32 * inv_rms).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    out_ptr,
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_x_token,
    stride_x_head,
    num_heads,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    heads = tl.arange(0, HEADS_PAD)
    offs = tl.arange(0, HALF_PAD)
    col_mask = offs < HALF
    mask = (heads < num_heads)[:, None] & col_mask[None, :]
    # cos/sin rows repeat their first half, so the first half is all a rotation needs.
    cos = tl.load(cos_ptr + pos * (2 * HALF) + offs, mask=col_mask, other=0.0)
    sin = tl.load(sin_ptr + pos * (2 * HALF) + offs, mask=col_mask, other=0.0)
    src = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    # Same roundings as the reference: cos/sin cast to the input dtype, each product rounded.
    cos = cos.to(dtype).to(tl.float32)[None, :]
    sin = sin.to(dtype).to(tl.float32)[None, :]
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (a * cos).to(dtype).to(tl.float32) - (b * sin).to(dtype).to(tl.float32)
    out2 = (b * cos).to(dtype).to(tl.float32) + (a * sin).to(dtype).to(tl.float32)
    dst = out_ptr + token * (num_heads * 2 * HALF) + heads[:, None] * (2 * HALF) + offs[None, :]
    tl.store(dst, out1.to(dtype), mask=mask)
    tl.store(dst + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _act_and_mul_kernel(
    out_ptr, x_ptr, stride_x, width, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + width + offs, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    if ACTIVATION == "silu":
        act = g32 / (1.0 + tl.exp(-g32))
    else:
        # gelu_tanh: 0.5 * g * (1 + tanh(u)) with u = sqrt(2/pi) * (g + 0.044715 g^3) equals
        # g * sigmoid(2u), which needs no tanh and does not cancel for negative g.
        two_u = 1.5957691216057308 * (g32 + 0.044715 * g32 * g32 * g32)  # 2 * sqrt(2 / pi)
        act = g32 / (1.0 + tl.exp(-two_u))
    out = act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * width + offs, out.to(gate.dtype), mask=mask)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """Like ``llm_kernels.ops.rms_norm``: ``x`` ``[num_tokens, hidden]`` (rows may be strided),
    ``weight`` ``[hidden]``; returns new contiguous tensors."""
    _check_rows("x", x)
    hidden = x.shape[1]
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"x: hidden size must be <= {_MAX_HIDDEN}, got {hidden}")
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{hidden}] tensor, got {list(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    if residual is not None:
        _check_rows("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(
                f"residual must match x ({list(x.shape)}, {x.dtype}, {x.device}), got "
                f"({list(residual.shape)}, {residual.dtype}, {residual.device})"
            )
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            out,
            residual_out,
            x,
            x if residual is None else residual,
            weight,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            hidden,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out if residual is None else (out, residual_out)


def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor]:
    """Like ``llm_kernels.ops.rotary_embedding``: new contiguous rotated query and key."""
    if positions.dim() != 1 or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be a 1-D int64 tensor, got {positions.dtype} {list(positions.shape)}"
        )
    num_tokens = positions.shape[0]
    for name, t in (("query", query), ("key", key)):
        if t.dim() != 3 or t.shape[0] != num_tokens or t.stride(2) != 1:
            raise ValueError(
                f"{name} must be [{num_tokens}, heads, head_dim] with a contiguous last dim, "
                f"got shape {list(t.shape)} strides {list(t.stride())}"
            )
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype must be float16, bfloat16 or float32, got {t.dtype}")
        if t.device != positions.device:
            raise ValueError(f"{name} is on {t.device} but positions is on {positions.device}")
    head_dim = query.shape[2]
    if key.shape[2] != head_dim or key.dtype != query.dtype:
        raise ValueError(f"key must have query's head_dim {head_dim} and dtype {query.dtype}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != head_dim or t.dtype != torch.float32:
            raise ValueError(
                f"{name} must be float32 [max_position, {head_dim}], got {t.dtype} {list(t.shape)}"
            )
        if not t.is_contiguous() or t.device != query.device:
            raise ValueError(f"{name} must be contiguous and on {query.device}")
    check_triton_device(query.device, "query")
    outs = []
    for t in (query, key):
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        if num_tokens:
            _rotary_kernel[(num_tokens,)](
                out,
                t,
                positions,
                cos,
                sin,
                t.stride(0),
                t.stride(1),
                t.shape[1],
                HALF=head_dim // 2,
                HEADS_PAD=triton.next_power_of_2(t.shape[1]),
                HALF_PAD=triton.next_power_of_2(head_dim // 2),
            )
        outs.append(out)
    return outs[0], outs[1]


def silu_and_mul(x: Tensor) -> Tensor:
    """Like ``llm_kernels.ops.silu_and_mul``: ``x`` ``[num_tokens, 2 * width]`` -> ``[num_tokens,
    width]``."""
    return _act_and_mul(x, "silu")


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """Like ``llm_kernels.ops.gelu_tanh_and_mul``: ``x`` ``[num_tokens, 2 * width]`` ->
    ``[num_tokens, width]``."""
    return _act_and_mul(x, "gelu_tanh")


def _act_and_mul(x: Tensor, activation: str) -> Tensor:
    _check_rows("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"x: last dim must be even ([gate | up]), got {x.shape[1]}")
    width = x.shape[1] // 2
    out = torch.empty((x.shape[0], width), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        grid = (x.shape[0], triton.cdiv(width, _ACT_BLOCK))
        _act_and_mul_kernel[grid](
            out, x, x.stride(0), width, ACTIVATION=activation, BLOCK=_ACT_BLOCK
        )
    return out


def _check_rows(name: str, t: Tensor) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(
            f"{name} must be [num_tokens, hidden] with a contiguous last dim, got shape "
            f"{list(t.shape)} strides {list(t.stride())}"
        )
    if t.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype must be float16, bfloat16 or float32, got {t.dtype}")
    check_triton_device(t.device, name)
