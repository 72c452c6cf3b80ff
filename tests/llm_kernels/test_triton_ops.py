"""llm_kernels.triton_ops (fused RMSNorm, rotary, SiLU-and-mul, GELU-tanh-and-mul) against
llm_kernels.ops or torch, through the Triton interpreter without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llm_kernels import ops, triton_ops
from llm_kernels.backend import get_kernel_ops

# bf16 tolerances absorb the interpreter's truncating float32 -> bfloat16 casts.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype):
    x, weight = torch.randn(5, 96).to(dtype), torch.randn(96).to(dtype)
    close(triton_ops.rms_norm(x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_returns_normed_sum_and_sum(dtype):
    x, residual, weight = (torch.randn(shape).to(dtype) for shape in ((4, 80), (4, 80), (80,)))
    normed, summed = triton_ops.rms_norm(x, weight, 1e-5, residual)
    want_normed, want_summed = ops.rms_norm(x, weight, 1e-5, residual)
    close(normed, want_normed)
    close(summed, want_summed)


def test_rms_norm_rejects_weight_of_wrong_size():
    with pytest.raises(ValueError, match=r"weight must be a contiguous \[64\] tensor"):
        triton_ops.rms_norm(torch.randn(2, 64), torch.randn(32), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_rotary_embedding_matches_reference(dtype, head_dim):
    half = torch.randn(50, head_dim // 2)
    cos, sin = half.cos().repeat(1, 2), half.sin().repeat(1, 2)
    positions = torch.tensor([3, 0, 49])
    qkv = torch.randn(3, 8, head_dim).to(dtype)
    query, key = qkv[:, :4], qkv[:, 4:6]  # strided views, as the model passes them
    got = triton_ops.rotary_embedding(positions, query, key, cos, sin)
    want = ops.rotary_embedding(positions, query, key, cos, sin)
    close(got[0], want[0])
    close(got[1], want[1])


def test_rotary_embedding_rejects_odd_head_dim():
    q = torch.randn(1, 2, 7)
    with pytest.raises(ValueError, match="head_dim must be even"):
        triton_ops.rotary_embedding(torch.tensor([0]), q, q, torch.ones(4, 7), torch.ones(4, 7))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference_across_several_column_blocks(dtype):
    x = torch.randn(3, 2 * 1500).to(dtype)
    close(triton_ops.silu_and_mul(x), ops.silu_and_mul(x))


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="last dim must be even"):
        triton_ops.silu_and_mul(torch.randn(2, 7))


# The interpreter warns where exp overflows to inf, which the kernel means: g / inf = -0.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gelu_tanh_and_mul", [ops.gelu_tanh_and_mul, triton_ops.gelu_tanh_and_mul])
def test_gelu_tanh_and_mul_matches_torch_tanh_gelu(dtype, gelu_tanh_and_mul):
    x = 3 * torch.randn(3, 2 * 1500)  # several Triton column blocks
    x[:, :2] = torch.tensor([-40.0, 40.0])  # gates whose exp overflows either way
    x = x.to(dtype)
    gate, up = x.chunk(2, dim=-1)
    close(gelu_tanh_and_mul(x), F.gelu(gate, approximate="tanh") * up)


def test_gelu_tanh_and_mul_reads_strided_rows():
    x = torch.randn(4, 2 * 96)
    wide = torch.cat([x, torch.zeros_like(x)], dim=1)[:, : 2 * 96]
    close(triton_ops.gelu_tanh_and_mul(wide), ops.gelu_tanh_and_mul(x))


def test_both_backends_provide_gelu_tanh_and_mul():
    assert get_kernel_ops("torch").gelu_tanh_and_mul is ops.gelu_tanh_and_mul
    assert get_kernel_ops("triton").gelu_tanh_and_mul is triton_ops.gelu_tanh_and_mul


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_ops_match_reference_at_llama_8b_sizes():
    x, residual = (torch.randn(512, 4096, dtype=torch.bfloat16, device="cuda") for _ in "xr")
    weight = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    got, want = (
        triton_ops.rms_norm(x, weight, 1e-5, residual),
        ops.rms_norm(x, weight, 1e-5, residual),
    )
    close(got[0], want[0])
    close(got[1], want[1])
    gate_up = torch.randn(512, 2 * 14336, dtype=torch.bfloat16, device="cuda")
    close(triton_ops.silu_and_mul(gate_up), ops.silu_and_mul(gate_up))
    half = torch.randn(8192, 64, device="cuda")
    cos, sin = half.cos().repeat(1, 2), half.sin().repeat(1, 2)
    positions = torch.randint(0, 8192, (512,), device="cuda")
    q, k = (
        torch.randn(512, 32, 128, dtype=torch.bfloat16, device="cuda"),
        x.view(512, 32, 128)[:, :8],
    )
    for g, w in zip(
        triton_ops.rotary_embedding(positions, q, k, cos, sin),
        ops.rotary_embedding(positions, q, k, cos, sin),
        strict=True,
    ):
        close(g, w)
