"""The native CPU layer kernels (``llm_kernels.cpu_layer_kernels``) against the torch functions
they stand in for (``llm_kernels.ops``, ``llm_kernels.attention.reshape_and_cache``): rotary and
the cache write bit for bit, RMSNorm up to the order of its sum of squares; calls they do not
cover fall back to the torch path."""

from __future__ import annotations

import pytest
import torch

from llm_kernels import attention, cpu_layer_kernels, ops
from llm_kernels.backend import get_kernel_ops

pytestmark = pytest.mark.skipif(
    not cpu_layer_kernels.available(), reason="the native CPU pointwise kernels do not build here"
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
        (cpu_layer_kernels.rms_norm(x, weight, 1e-5), ops.rms_norm(x, weight, 1e-5)),
        (
            cpu_layer_kernels.rms_norm(x, weight, 1e-5, residual),
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
    got_q, got_k = cpu_layer_kernels.rotary_embedding(positions, q, k, cos, sin)
    want_q, want_k = ops.rotary_embedding(positions, q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.is_contiguous() and got_k.is_contiguous()


def test_a_position_outside_the_table_is_an_error() -> None:
    q = torch.zeros(2, 1, 8)
    cos = sin = torch.zeros(16, 8)
    with pytest.raises(RuntimeError, match=r"positions\[1\] = 16 is outside"):
        cpu_layer_kernels.rotary_embedding(torch.tensor([3, 16]), q, q, cos, sin)


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
        got = cpu_layer_kernels.rms_norm(inputs, w, 1e-6)
        want = ops.rms_norm(inputs, w, 1e-6)
        assert got.dtype == want.dtype and torch.equal(got, want)
    q = torch.randn(3, 2, 8, generator=g).half()
    cos = sin = torch.randn(16, 8, generator=g)
    positions = torch.tensor([0, 5, 15])
    for got, want in zip(
        cpu_layer_kernels.rotary_embedding(positions, q, q, cos, sin),
        ops.rotary_embedding(positions, q, q, cos, sin),
    ):
        assert torch.equal(got, want)


def test_the_cpu_backend_uses_them_and_the_torch_backend_does_not() -> None:
    native = get_kernel_ops("cpu")
    assert native.rms_norm is cpu_layer_kernels.rms_norm
    assert native.rotary_embedding is cpu_layer_kernels.rotary_embedding
    assert native.reshape_and_cache.keywords == {"row_writer": cpu_layer_kernels.write_cache_rows}
    assert get_kernel_ops("torch").rms_norm is ops.rms_norm
    assert get_kernel_ops("torch").reshape_and_cache is attention.reshape_and_cache


def _write_both(
    key: torch.Tensor, value: torch.Tensor | None, cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache after the native write and after the torch path's, from one starting cache."""
    native, reference = cache.clone(), cache.clone()
    attention.reshape_and_cache(
        key, value, native, slots, row_writer=cpu_layer_kernels.write_cache_rows
    )
    attention.reshape_and_cache(key, value, reference, slots)
    return native, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cache_write_equals_the_torch_path(dtype: torch.dtype) -> None:
    g = _gen(3)
    tokens, kv_heads, head_dim, blocks, block_size = 7, 2, 16, 5, 4
    cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    # key and value as the attention layer passes them: strided views of one fused row.
    fused = torch.randn(tokens, 2 * kv_heads * head_dim, generator=g).to(dtype)
    key = fused[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = fused[:, kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([0, 19, -1, 5, 6, -1, 12])  # two tokens not written
    native, reference = _write_both(key, value, cache, slots)
    assert torch.equal(native, reference)
    assert not torch.equal(native, cache)


def test_the_cache_write_fills_a_one_plane_latent_cache() -> None:
    g = _gen(4)
    cache = torch.zeros(1, 3, 4, 1, 24).bfloat16()
    key = torch.randn(5, 1, 24, generator=g).bfloat16()
    native, reference = _write_both(key, None, cache, torch.tensor([11, 0, 3, -1, 7]))
    assert torch.equal(native, reference)


def test_a_slot_past_the_cache_is_an_error_and_writes_nothing() -> None:
    cache = torch.zeros(2, 2, 4, 1, 8)
    key = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 8 is past the cache's 8 slots"):
        cpu_layer_kernels.write_cache_rows(key, key, cache, torch.tensor([0, 8]))
    assert not cache.any()


def test_an_fp8_cache_is_left_to_the_torch_path() -> None:
    cache = torch.zeros(2, 2, 4, 1, 8, dtype=torch.float8_e4m3fn)
    key = torch.ones(2, 1, 8)
    assert not cpu_layer_kernels.write_cache_rows(key, key, cache, torch.tensor([0, 1]))
