"""The native CPU RMSNorm and rotary embedding (``llm_kernels.cpu_pointwise``) against the torch
functions they stand in for (``llm_kernels.ops``): rotary bit for bit, RMSNorm up to the order
of its sum of squares; calls they do not cover fall back to those functions."""

from __future__ import annotations

import pytest
import torch

from llm_kernels import cpu_pointwise, ops
from llm_kernels.backend import get_kernel_ops

pytestmark = pytest.mark.skipif(
    not cpu_pointwise.available(), reason="the native CPU pointwise kernels do not build here"
)

DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 768), (37, 96), (5, 3, 64), (4, 100), (0, 64), (600, 40)])
def test_rms_norm_matches_the_torch_path(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = _gen(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    residual = torch.randn(*shape, generator=g).to(dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    for got, want in [
        (cpu_pointwise.rms_norm(x, weight, 1e-5), ops.rms_norm(x, weight, 1e-5)),
        (
            cpu_pointwise.rms_norm(x, weight, 1e-5, residual),
            ops.rms_norm(x, weight, 1e-5, residual),
        ),
    ]:
        if isinstance(want, tuple):
            (got, got_sum), (want, want_sum) = got, want
            assert torch.equal(got_sum, want_sum)  # x + residual, rounded as torch rounds it
        assert got.dtype == want.dtype and got.shape == want.shape
        if dtype == torch.float32:  # the sum of squares is added in another order
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        else:  # rounding to bfloat16 hides that order almost always: at most one unit apart
            torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
            assert (got != want).sum().item() <= max(1, got.numel() // 1000)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [0, 1, 9, 300])
@pytest.mark.parametrize("width", [64, 32])  # the whole head, or a partial rotary width
def test_rotary_equals_the_torch_path_bit_for_bit(
    dtype: torch.dtype, tokens: int, width: int
) -> None:
    g = _gen(tokens + width)
    heads, kv_heads, head_dim = 6, 2, 64
    # q and k as the attention layer passes them: strided views of one fused QKV row.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)[..., :width]
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    k = k[..., :width]
    cos = torch.randn(512, width, generator=g)
    sin = torch.randn(512, width, generator=g)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    got_q, got_k = cpu_pointwise.rotary_embedding(positions, q, k, cos, sin)
    want_q, want_k = ops.rotary_embedding(positions, q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.is_contiguous() and got_k.is_contiguous()


def test_a_position_outside_the_table_is_an_error() -> None:
    q = torch.zeros(2, 1, 8)
    cos = sin = torch.zeros(16, 8)
    with pytest.raises(RuntimeError, match=r"positions\[1\] = 16 is outside"):
        cpu_pointwise.rotary_embedding(torch.tensor([3, 16]), q, q, cos, sin)


def test_calls_the_native_code_does_not_cover_take_the_torch_path() -> None:
    g = _gen(1)
    x = torch.randn(4, 32, generator=g)
    weight = torch.randn(32, generator=g)
    cases = [
        (x.half(), weight.half()),  # another dtype
        (x.t().contiguous().t(), weight),  # not contiguous
        (x.bfloat16(), weight),  # a float32 weight on a bfloat16 input: torch promotes
    ]
    for inputs, w in cases:
        got = cpu_pointwise.rms_norm(inputs, w, 1e-6)
        want = ops.rms_norm(inputs, w, 1e-6)
        assert got.dtype == want.dtype and torch.equal(got, want)
    q = torch.randn(3, 2, 8, generator=g).half()
    cos = sin = torch.randn(16, 8, generator=g)
    positions = torch.tensor([0, 5, 15])
    for got, want in zip(
        cpu_pointwise.rotary_embedding(positions, q, q, cos, sin),
        ops.rotary_embedding(positions, q, q, cos, sin),
    ):
        assert torch.equal(got, want)


def test_the_cpu_backend_uses_them_and_the_torch_backend_does_not() -> None:
    assert get_kernel_ops("cpu").rms_norm is cpu_pointwise.rms_norm
    assert get_kernel_ops("cpu").rotary_embedding is cpu_pointwise.rotary_embedding
    assert get_kernel_ops("torch").rms_norm is ops.rms_norm
