"""llm_kernels.quant_gemm and its Triton kernels (llm_kernels.triton_quant_gemm).

The torch references are checked against a float64 dequantize-and-multiply written out here,
and the int4 layout against compressed-tensors' own pack/unpack; the Triton kernels (the
interpreter without CUDA) against the references at small shapes. The ``gpu`` tests run the
CUDA paths (torch._scaled_mm, the FP8 block kernel, the W4A16 kernel) at Llama-3-70B's layer
shapes under TP 2."""

from __future__ import annotations

import math

import pytest
import torch

from llm_kernels import triton_quant_gemm
from llm_kernels.fp8_activations import quantize_activations_fp8
from llm_kernels.kv_quant import FP8_DTYPE
from llm_kernels.quant_gemm import (
    fp8_linear,
    fp8_linear_reference,
    pack_int4,
    unpack_int4,
    w4a16_linear,
    w4a16_linear_reference,
)


def fp8_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)


def int4_weight(n: int, k: int, group: int, *, zero: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, math.ceil(k / group), generator=gen) * 0.02 + 0.001
    zp = torch.randint(-2, 3, scale.shape, generator=gen, dtype=torch.int8) if zero else None
    return q, pack_int4(q), scale, zp


# ---- int4 layout and the W4A16 reference -----------------------------------------------------


def test_int4_packing_is_compressed_tensors_layout():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = torch.randint(-8, 8, (6, 64), dtype=torch.int8)
    ours = pack_int4(q)
    assert torch.equal(ours, helpers.pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(ours, 64), helpers.unpack_from_int32(ours, 4, q.shape))
    # Low nibble first, stored plus 8: value 0 of word 0 is bits 0-3.
    assert int(ours[0, 0]) & 0xF == int(q[0, 0]) + 8


@pytest.mark.parametrize("zero", [False, True])
def test_w4a16_reference_is_grouped_dequantize_then_matmul(zero):
    q, packed, scale, zp = int4_weight(24, 96, 32, zero=zero)
    x = torch.randn(3, 2, 96)
    bias = torch.randn(24)
    w = q.double() - (zp.double().repeat_interleave(32, 1) if zero else 0)
    w = w * scale.double().repeat_interleave(32, 1)
    expected = x.double() @ w.T + bias.double()
    got = w4a16_linear_reference(x, packed, scale, zp, 32, bias)
    assert got.shape == (3, 2, 24)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(w4a16_linear(x, packed, scale, zp, 32, bias), got)  # CPU: the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,zero", [(64, False), (32, True), (128, True)])
def test_triton_w4a16_matches_reference(dtype, group, zero):
    _, packed, scale, zp = int4_weight(80, 256, group, zero=zero)
    x = torch.randn(5, 256).to(dtype)
    bias = torch.randn(80).to(dtype) if zero else None
    scale = scale.to(dtype)
    got = triton_quant_gemm.w4a16_gemm(x, packed, scale, zp, group, bias)
    expected = w4a16_linear_reference(x, packed, scale, zp, group, bias)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_w4a16_refuses_mismatched_shapes_by_name():
    _, packed, scale, zp = int4_weight(16, 64, 32, zero=True)
    with pytest.raises(ValueError, match=r"weight_scale: must have shape \[16, 2\]"):
        w4a16_linear(torch.randn(2, 64), packed, scale[:, :1], None, 32)
    with pytest.raises(ValueError, match=r"weight_zero_point: must have shape \[16, 2\]"):
        w4a16_linear(torch.randn(2, 64), packed, scale, zp.T, 32)
    with pytest.raises(ValueError, match="x: must be floating point"):
        w4a16_linear(torch.randn(2, 72), packed, scale, None, 32)


# ---- FP8 ------------------------------------------------------------------------------------


def _fp8_expected(x, w, w_scale_grid, x_scale_grid, x_q, bias):
    out = (x_q.double() * x_scale_grid.double()) @ (w.double() * w_scale_grid.double()).T
    return out + (bias.double() if bias is not None else 0)


def test_activation_quantization_maps_each_tokens_max_to_448():
    x = torch.tensor([[1.0, -3.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    x_q, scale = quantize_activations_fp8(x)
    assert scale.shape == (2, 1) and x_q.float()[0, 1] == -448.0
    assert not x_q.float()[1].any()  # an all-zero token stays zero (no 0 / 0)
    x_q, scale = quantize_activations_fp8(torch.randn(3, 40), group=16)
    assert scale.shape == (3, 3)


@pytest.mark.parametrize("scale_kind", ["tensor_static", "tensor_dynamic", "channel"])
def test_fp8_reference_per_tensor_and_per_channel(scale_kind):
    w = fp8_weight(32, 64)
    x = torch.randn(4, 64)
    bias = torch.randn(32)
    w_scale = torch.rand(32, 1) * 0.01 if scale_kind == "channel" else torch.tensor(0.004)
    input_scale = torch.tensor(0.02) if scale_kind == "tensor_static" else None
    got = fp8_linear_reference(x, w, w_scale, None, input_scale, bias, torch.float32)
    x_q, x_scale = quantize_activations_fp8(x, input_scale)
    if input_scale is not None:
        assert torch.equal(x_q, (x / 0.02).clamp(-448, 448).to(FP8_DTYPE))
    expected = _fp8_expected(x, w, w_scale.reshape(-1, 1), x_scale, x_q, bias)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(fp8_linear(x, w, w_scale, None, input_scale, bias, torch.float32), got)


def test_fp8_reference_block_scales():
    w = fp8_weight(70, 96)  # N, K not multiples of the (32, 32) blocks
    w_scale = torch.rand(3, 3) * 0.01
    x = torch.randn(5, 96).to(torch.bfloat16)
    got = fp8_linear_reference(x, w, w_scale, (32, 32), out_dtype=torch.float32)
    x_q, x_scale = quantize_activations_fp8(x, None, 32)
    w_grid = w_scale.repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)
    x_grid = x_scale.repeat_interleave(32, 1)
    torch.testing.assert_close(
        got.double(), _fp8_expected(x, w, w_grid, x_grid, x_q, None), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("bias", [False, True])
def test_triton_fp8_block_kernel_matches_reference(bias):
    w = fp8_weight(100, 128, seed=1)
    w_scale = torch.rand(2, 4) * 0.01  # block (64, 32): N = 100 leaves a partial block
    x = torch.randn(7, 128)
    b = torch.randn(100) if bias else None
    got = triton_quant_gemm.fp8_block_linear(x, w, w_scale, (64, 32), b, torch.float32)
    expected = fp8_linear_reference(x, w, w_scale, (64, 32), None, b, torch.float32)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_fp8_refuses_bad_arguments_by_name():
    w = fp8_weight(32, 64)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"weight_scale: must be one value, \[32\] or \[32, 1\]"):
        fp8_linear(x, w, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"weight_scale: must have shape \[1, 2\]"):
        fp8_linear(x, w, torch.ones(2, 2), block_size=(32, 32))
    with pytest.raises(ValueError, match="input_scale: must be None with block scales"):
        fp8_linear(x, w, torch.ones(1, 2), (32, 32), input_scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="weight: must be a 2-D float8_e4m3fn"):
        fp8_linear(x, w.float(), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"x: must be floating point \[..., 64\]"):
        fp8_linear(torch.randn(2, 32), w, torch.tensor(1.0))


# ---- GPU: Llama-3-70B's layers at TP 2 (hidden 8192, intermediate 28672, 64/8 heads) -------------

# (name, N, K) of one TP-2 rank: qkv (64 + 2 * 8 heads) * 128 / 2, o_proj, gate_up, down.
LLAMA_70B_TP2 = [
    ("qkv_proj", 5120, 8192),
    ("o_proj", 8192, 4096),
    ("gate_up_proj", 28672, 8192),
    ("down_proj", 8192, 14336),
]


def _gpu_close(got, expected):
    # bf16 outputs of K-long FP8 sums in another order: relative to the output's scale.
    err = (got.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert err < 2e-2, f"max error {err:.2e} of the output's range"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,n,k", LLAMA_70B_TP2)
@pytest.mark.parametrize("m", [16, 256])
def test_gpu_fp8_linear_at_llama_70b_tp2_shapes(name, n, k, m):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    w = fp8_weight(n, k).cuda()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for scale, block in (
        (torch.rand(n, 1, device="cuda") * 0.01, None),
        (torch.rand(n // 128, k // 128, device="cuda") * 0.01, (128, 128)),
    ):
        got = fp8_linear(x, w, scale, block, out_dtype=torch.bfloat16)
        _gpu_close(got, fp8_linear_reference(x, w, scale, block, out_dtype=torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,n,k", LLAMA_70B_TP2)
@pytest.mark.parametrize("m", [16, 256])
def test_gpu_w4a16_at_llama_70b_tp2_shapes(name, n, k, m):
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device="cuda")
    packed = pack_int4(q)
    scale = (torch.rand(n, k // 128, device="cuda") * 0.02).to(torch.bfloat16)
    zp = torch.randint(-2, 3, scale.shape, dtype=torch.int8, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = w4a16_linear(x, packed, scale, zp, 128)
    _gpu_close(got, w4a16_linear_reference(x.float(), packed, scale, zp, 128))
