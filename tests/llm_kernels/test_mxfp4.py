"""MXFP4 as plain torch (``llm_kernels.mxfp4``): dequantization equals transformers' bit for bit in
float32 and bfloat16 over every code and every finite scale byte, whatever the chunking; the
quantizer reproduces representable values exactly; malformed pairs are refused by shape."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from llm_kernels.mxfp4 import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4


def _every_code_and_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [E, R, G, 16] holding every byte, scales covering 0..254 (255 is E8M0's NaN)."""
    g = torch.Generator().manual_seed(0)
    num_experts, rows, groups = 3, 17, 5
    blocks = torch.randint(0, 256, (num_experts, rows, groups, 16), dtype=torch.uint8, generator=g)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scales = torch.randint(0, 255, (num_experts, rows, groups), dtype=torch.uint8, generator=g)
    scales.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    blocks, scales = _every_code_and_scale()
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, G * 32, R]
    got = dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2).contiguous()
    assert got.dtype == dtype
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_dequantize_is_the_same_in_chunks_of_any_size() -> None:
    blocks, scales = _every_code_and_scale()
    whole = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    chunked = dequantize_mxfp4(blocks, scales, torch.bfloat16, rows_per_chunk=7)
    assert torch.equal(whole.view(torch.uint8), chunked.view(torch.uint8))


def test_the_low_nibble_is_the_first_value_of_a_byte() -> None:
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x72  # low 2 -> 1.0, high 7 -> 6.0
    scales = torch.full((1, 1), 128, dtype=torch.uint8)  # x 2
    values = dequantize_mxfp4(blocks, scales, torch.float32)
    assert values[0, :3].tolist() == [2.0, 12.0, 0.0]


def test_quantize_keeps_representable_values_exactly() -> None:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (4, 64), generator=g)
    exponents = torch.randint(-10, 10, (4, 2, 1), generator=g).float()
    values = torch.tensor(E2M1_VALUES)[codes].view(4, 2, 32) * torch.exp2(exponents)
    values = values.view(4, 64)
    blocks, scales = quantize_mxfp4(values)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), values)


def test_quantize_error_is_bounded_by_the_group_scale() -> None:
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(2))
    blocks, scales = quantize_mxfp4(w)
    error = (dequantize_mxfp4(blocks, scales, torch.float32) - w).abs().view(8, 4, 32)
    # In units of the group's scale the largest magnitude is in [4, 8): rounding costs at
    # most half the widest step (1, between 4 and 6), saturating [6, 8) at 6 at most 2.
    scale = 2.0 ** (scales.float() - 127).unsqueeze(-1)
    assert bool((error <= 2 * scale).all())


def test_scales_not_matching_the_blocks_are_refused_with_both_shapes() -> None:
    blocks = torch.zeros(2, 4, 3, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"scales \[2, 4, 2\] must be blocks \[2, 4, 3, 16\]"):
        dequantize_mxfp4(blocks, torch.zeros(2, 4, 2, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="scales must be uint8"):
        dequantize_mxfp4(blocks, torch.zeros(2, 4, 3), torch.float32)
