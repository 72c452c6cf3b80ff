"""MXFP4 (the OCP microscaling format gpt-oss ships its experts in) as plain torch: unpacking
to dense values and packing dense values into it.

A row of K values is stored as K / 32 groups; each group has one E8M0 scale byte (the value
``2^(s - 127)``) and 16 bytes of E2M1 codes, two per byte, the low nibble first::

    blocks [..., G, 16] uint8   byte j of group g: the codes of values 32g + 2j (low nibble)
                                and 32g + 2j + 1 (high nibble)
    scales [..., G]     uint8   w[32g + i] = E2M1[code] * 2^(scales[g] - 127)

E2M1 codes: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa, so the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6. A value times a power of two is exact in float32 (and, within
bfloat16's exponent range, which equals float32's, in bfloat16); dequantizing computes it in
float32 and rounds once to the target dtype, which is what HF's ``ldexp`` gives.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "E2M1_VALUES",
    "VALUES_PER_SCALE",
    "dequantize_mxfp4",
    "mxfp4_scale_values",
    "quantize_mxfp4",
]

E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
VALUES_PER_SCALE = 32
BYTES_PER_GROUP = VALUES_PER_SCALE // 2
SCALE_BIAS = 127
_E2M1_MAX_EXPONENT = 2  # 6 = 1.5 * 2^2: a group's largest magnitude sets its scale from this


def check_mxfp4(blocks: Tensor, scales: Tensor, what: str = "mxfp4") -> None:
    """``blocks [..., G, 16]`` and ``scales [..., G]``, both uint8 with the same leading dims;
    ValueError naming ``what`` and both shapes otherwise."""
    for name, t in (("blocks", blocks), ("scales", scales)):
        if t.dtype != torch.uint8:
            raise ValueError(f"{what}: {name} must be uint8, got {t.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BYTES_PER_GROUP:
        raise ValueError(
            f"{what}: blocks must be [..., groups, {BYTES_PER_GROUP}], got {list(blocks.shape)}"
        )
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"{what}: scales {list(scales.shape)} must be blocks {list(blocks.shape)} without "
            f"its last dim ({list(blocks.shape[:-1])})"
        )


def mxfp4_scale_values(scales: Tensor) -> Tensor:
    """E8M0 bytes -> ``2^(s - 127)`` in float32, built from the bits: ``s << 23`` is that power
    for s >= 1, 2^-127 is the subnormal ``1 << 22``, and s = 255 gives inf (as ``ldexp`` does)."""
    s = scales.to(torch.int32)
    return torch.where(s > 0, s << 23, 1 << 22).view(torch.float32)


def dequantize_mxfp4(
    blocks: Tensor, scales: Tensor, dtype: torch.dtype, *, rows_per_chunk: int = 1 << 16
) -> Tensor:
    """``blocks [..., G, 16]``, ``scales [..., G]`` -> the values ``[..., G * 32]`` in ``dtype``.

    Bit for bit HF's ``convert_moe_packed_tensors`` (before its transpose): each product is
    exact in float32, rounded once to ``dtype``. Works through ``rows_per_chunk`` groups at a
    time, so the float32 temporaries stay small whatever the tensor."""
    check_mxfp4(blocks, scales)
    *lead, groups, _ = blocks.shape
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    flat_blocks = blocks.reshape(-1, BYTES_PER_GROUP)
    flat_scales = scales.reshape(-1, 1)
    out = torch.empty(flat_blocks.shape[0], VALUES_PER_SCALE, dtype=dtype, device=blocks.device)
    for start in range(0, flat_blocks.shape[0], rows_per_chunk):
        end = start + rows_per_chunk
        codes = flat_blocks[start:end]
        values = torch.stack([table[(codes & 0xF).long()], table[(codes >> 4).long()]], dim=-1)
        values = values.flatten(-2) * mxfp4_scale_values(flat_scales[start:end])
        out[start:end] = values
    return out.reshape(*lead, groups * VALUES_PER_SCALE)


def quantize_mxfp4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Dense ``[..., K]`` (K a multiple of 32) -> ``(blocks [..., K/32, 16], scales [..., K/32])``.

    Each group's scale is ``2^(floor(log2(max |w|)) - 2)`` (the OCP rule: the largest magnitude
    lands in [4, 8)); each value is rounded to the nearest E2M1 magnitude (a tie to the
    smaller one) and saturated at 6; an all-zero group gets scale byte 0. For tests and tools:
    the engine never quantizes on its own."""
    if weight.shape[-1] % VALUES_PER_SCALE:
        raise ValueError(
            f"weight: last dim {weight.shape[-1]} must be a multiple of {VALUES_PER_SCALE}"
        )
    w = weight.to(torch.float32)
    grouped = w.reshape(*w.shape[:-1], -1, VALUES_PER_SCALE)
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    exponent = torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - _E2M1_MAX_EXPONENT
    byte = (exponent + SCALE_BIAS).clamp(0, 254)
    byte = torch.where(amax > 0, byte, torch.zeros_like(byte))
    scaled = grouped / mxfp4_scale_values(byte.to(torch.uint8))
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    distance = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - magnitudes).abs()
    code = distance.argmin(dim=-1)
    code = code | torch.where(scaled < 0, 8, 0)
    pairs = code.reshape(*code.shape[:-1], BYTES_PER_GROUP, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, byte.squeeze(-1).to(torch.uint8)
