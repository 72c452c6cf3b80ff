"""Quantized tensor formats as plain torch: unpacking, conversion to the engine's one int4
form, dequantization, FP8 quantization of weights (online) and of activations.

The int4 form is compressed-tensors' pack-quantized layout, which the CUDA W4A16 kernel
reads: signed q in [-8, 7] stored as q + 8, eight per int32 along the input dimension, lowest
nibble first (``weight_packed`` [N, K // 8]); scales [N, groups]; zero points, where there are
any, unpacked [N, groups] in the same signed convention, so w = (q - zp) * scale. GPTQ's and
AWQ's unsigned nibbles (q_u in [0, 15], w = (q_u - z_u) * scale) become q = q_u - 8,
zp = z_u - 8: the differences, hence the weights, are unchanged.

Dequantization follows the reference op for op. compressed-tensors computes
``(q.to(scale.dtype) - zp) * scale`` in the scale's dtype and the caller casts the result to
the compute dtype; so does ``dequantize_*`` here. GPTQ / AWQ have no library reference on CPU:
their weights are computed in float32 from the format's definition.
"""

from __future__ import annotations

import torch

from engine.quantization.config import ActivationQuant

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j of an int32 sits at bit 4j
# AWQ's GEMM packing puts column 8c + ORDER[j] in nibble j of word c.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(sorted(range(8), key=lambda j: _AWQ_ORDER[j]))


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> unsigned nibbles int32 [R, 8C], nibble j of word c at column 8c + j."""
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF
    return nibbles.reshape(packed.shape[0], -1)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """Unsigned nibbles [R, 8C] -> int32 [R, C]: the inverse of ``unpack_nibbles``."""
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"int4 packing needs a multiple of 8 columns, got {cols}")
    parts = (values.to(torch.int32) & 0xF).reshape(rows, cols // 8, 8) << _SHIFTS
    # The nibbles occupy disjoint bits, so their sum is their bitwise or; int64 holds it, and
    # the top nibble's bit 31 becomes int32's sign.
    words = parts.to(torch.int64).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_ct_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """compressed-tensors ``weight_packed`` [N, ceil(K / 8)] -> signed q int8 [N, K]."""
    return (unpack_nibbles(packed)[:, :cols] - 8).to(torch.int8)


def unpack_ct_zero_points(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """compressed-tensors asymmetric ``weight_zero_point`` [ceil(N / 8), G], packed along the
    output rows -> signed zp int8 [N, G]."""
    return (unpack_nibbles(packed.t().contiguous())[:, :rows] - 8).to(torch.int8).t()


def gptq_to_int4(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int | None,
    v1_zeros: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ ``qweight`` [K / 8, N] (packed along K), ``qzeros`` [G, N / 8] (packed along N),
    ``scales`` [G, N] -> (q int8 [N, K], zp int8 [N, G], scale [N, G]). GPTQ v1 stores each
    zero minus one (its packer's off-by-one), v2 the zero itself."""
    q_u = unpack_nibbles(qweight.t().contiguous())  # [N, K]
    z_u = unpack_nibbles(qzeros)[:, : scales.shape[1]]  # [G, N]
    if v1_zeros:
        z_u = z_u + 1
    _check_groups(q_u.shape[1], scales.shape[0], group_size, "gptq")
    return (q_u - 8).to(torch.int8), (z_u - 8).to(torch.int8).t(), scales.t()


def awq_to_int4(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ (GEMM) ``qweight`` [K, N / 8] and ``qzeros`` [G, N / 8], both packed along N in
    AWQ's interleaved order, ``scales`` [G, N] -> (q int8 [N, K], zp int8 [N, G], scale)."""
    q_u = _awq_unpack(qweight)  # [K, N]
    z_u = _awq_unpack(qzeros)  # [G, N]
    _check_groups(q_u.shape[0], scales.shape[0], group_size, "awq")
    return (q_u - 8).to(torch.int8).t(), (z_u - 8).to(torch.int8).t(), scales.t()


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    rows, words = packed.shape
    nibbles = unpack_nibbles(packed).reshape(rows, words, 8)
    return nibbles[:, :, list(_AWQ_UNDO)].reshape(rows, words * 8)


def _check_groups(k: int, groups: int, group_size: int | None, what: str) -> None:
    expected = 1 if group_size is None else -(-k // group_size)
    if groups != expected:
        raise ValueError(
            f"{what}: {groups} scale rows for {k} input features, expected {expected} "
            f"(group_size {group_size})"
        )


def dequantize_int4(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int | None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """(q - zp) * scale per group of ``group_size`` input columns (None: one group per row),
    computed in ``dtype`` (default: the scale's, as compressed-tensors does)."""
    dtype = dtype or scale.dtype
    n, k = q.shape
    size = k if group_size is None else group_size
    if k % size:
        raise ValueError(f"int4: in_features {k} is not a multiple of group_size {size}")
    grouped = q.reshape(n, k // size, size).to(dtype)
    if zero_point is not None:
        grouped = grouped - zero_point.reshape(n, -1, 1).to(dtype)
    return (grouped * scale.reshape(n, -1, 1).to(dtype)).reshape(n, k)


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """e4m3 [N, K] times its per-tensor ([] / [1]), per-channel ([N, 1]) or block
    ([ceil(N / bn), ceil(K / bk)]) scale, in float32 whatever the scale's dtype (as HF's
    compressed-tensors and fp8 loaders compute it: a bf16 scale multiplied in bf16 would round
    every weight to 8 bits of mantissa)."""
    dtype = torch.promote_types(scale.dtype, torch.float32)
    if block is None:
        return (
            weight.to(dtype) * scale.reshape(-1, 1)
            if scale.numel() > 1
            else (weight.to(dtype) * scale.reshape(()))
        )
    n, k = weight.shape
    bn, bk = block
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != expected:
        raise ValueError(f"fp8 block scale shape {list(scale.shape)} != expected {list(expected)}")
    full = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return weight.to(dtype) * full


def quantize_fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online FP8: scale = max |w| / 448 (float32), q = e4m3(clamp(w / scale)); an all-zero
    weight gets scale 1. Returns (q, scale [] float32)."""
    w = weight.to(torch.float32)
    amax = w.abs().amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fake_quantize_fp8_input(
    x: torch.Tensor, act: ActivationQuant, input_scale: torch.Tensor | None
) -> torch.Tensor:
    """Activations quantized to e4m3 and back as compressed-tensors' forward does it: a dynamic
    scale max |x| / 448 per token (or per ``group_size`` features of a token), zero replaced
    by float eps; or the static ``input_scale``. x / scale, clamped to +-448, cast, times scale."""
    if act.dynamic:
        size = act.group_size or x.shape[-1]
        grouped = x.unflatten(-1, (x.shape[-1] // size, size))
        amax = grouped.abs().amax(dim=-1, keepdim=True)
        scale = amax / (2 * FP8_MAX / 2)
        scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
        q = (grouped / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return (q.to(scale.dtype) * scale).flatten(-2)
    if input_scale is None:
        raise ValueError("static FP8 activation quantization needs the checkpoint's input_scale")
    scale = input_scale.to(x.dtype).reshape(())
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.to(x.dtype) * scale
