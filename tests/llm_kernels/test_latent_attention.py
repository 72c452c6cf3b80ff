"""Paged attention over a one-plane latent cache (multi-head latent attention): every head
attends one cached vector per token (MQA), the whole vector as the key and its first
``v_head_dim`` values as the value; against the float64 naive reference, for decode rows and
prefill chunks together, float32, bfloat16 and an FP8 cache; the cache writes and block moves
of both layouts; the native CPU decode kernel over DeepSeek's latent, and what it declines."""

from __future__ import annotations

import functools

import pytest
import torch

from llm_kernels import attention, cpu_decode
from llm_kernels.kv_quant import dequantize_kv, kv_cache_torch_dtype, quantize_kv
from tests.llm_kernels.naive_attention import naive_paged_attention
from tests.llm_kernels.native_cpu import native_decode, skip_unless_native
from tests.llm_kernels.triton_batches import paged_batch

# DeepSeek-V3's latent (512 + 64 rope) over 16 of its heads; a tiny one over 4.
SHAPES = {"deepseek": (16, 576, 512), "tiny": (4, 40, 32)}
# Decode rows and prefill chunks in one step, uneven contexts past several blocks.
QUERY_LENS = [1, 1, 7, 1, 20]
SEQ_LENS = [1, 45, 30, 17, 64]


def _latent_batch(shape: str, dtype: torch.dtype = torch.float32, block_size: int = 16):
    heads, dim, v_dim = SHAPES[shape]
    query, cache, metadata = paged_batch(
        QUERY_LENS, SEQ_LENS, num_heads=heads, num_kv_heads=1, head_dim=dim,
        block_size=block_size, dtype=dtype, planes=1,
    )  # fmt: skip
    return query, cache, metadata, v_dim, dim**-0.5


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [16, 32])
def test_torch_path_over_a_latent_cache_equals_the_naive_reference(
    shape: str, block_size: int
) -> None:
    query, cache, metadata, v_dim, scale = _latent_batch(shape, block_size=block_size)
    got = attention.paged_attention(query, cache, metadata, scale, v_head_dim=v_dim)
    assert got.shape == (query.shape[0], query.shape[1], v_dim)
    expected = naive_paged_attention(query, cache, metadata, scale, v_head_dim=v_dim)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_torch_path_over_a_bf16_latent_cache() -> None:
    query, cache, metadata, v_dim, scale = _latent_batch("deepseek", torch.bfloat16)
    got = attention.paged_attention(query, cache, metadata, scale, v_head_dim=v_dim)
    assert got.dtype == torch.bfloat16
    expected = naive_paged_attention(query, cache, metadata, scale, v_head_dim=v_dim)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)


def test_torch_path_over_an_fp8_latent_cache_equals_it_dequantized_with_k_scale() -> None:
    query, cache, metadata, v_dim, scale = _latent_batch("tiny")
    k_scale = 0.05
    fp8 = quantize_kv(cache, k_scale)
    assert fp8.dtype == kv_cache_torch_dtype("fp8", torch.float32)
    got = attention.paged_attention(
        query, fp8, metadata, scale, k_scale=k_scale, v_scale=123.0, v_head_dim=v_dim
    )  # v_scale has nothing to scale here
    dequantized = dequantize_kv(fp8, k_scale, torch.float32)
    expected = naive_paged_attention(query, dequantized, metadata, scale, v_head_dim=v_dim)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("v_head_dim", [None, 0, 41, 1.5])
def test_a_latent_cache_needs_a_v_head_dim_within_its_head_dim(v_head_dim: object) -> None:
    query, cache, metadata, _, scale = _latent_batch("tiny")
    with pytest.raises(ValueError, match=r"^v_head_dim must be an int in \[1, 40\]"):
        attention.paged_attention(query, cache, metadata, scale, v_head_dim=v_head_dim)


def test_a_kv_cache_takes_no_v_head_dim_but_its_own() -> None:
    query, cache, metadata = paged_batch([1], [5], num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"^v_head_dim is for a one-plane"):
        attention.paged_attention(query, cache, metadata, 0.25, v_head_dim=8)


def test_cache_write_to_a_latent_cache_takes_the_key_alone() -> None:
    cache = torch.zeros(1, 4, 16, 1, 40)
    latent = torch.randn(3, 1, 40)
    slots = torch.tensor([5, -1, 63])
    attention.reshape_and_cache(latent, None, cache, slots)
    flat = cache[0].view(-1, 1, 40)
    assert torch.equal(flat[5], latent[0]) and torch.equal(flat[63], latent[2])
    assert int((flat != 0).any(-1).sum()) == 2  # the negative slot wrote nothing
    with pytest.raises(ValueError, match=r"^value must be None for a one-plane"):
        attention.reshape_and_cache(latent, latent, cache, slots)
    with pytest.raises(ValueError, match=r"^value must be None for a one-plane"):
        attention.reshape_and_cache(latent, None, torch.zeros(2, 4, 16, 1, 40), slots)


def test_block_copies_and_swaps_move_a_latent_cache_whole() -> None:
    device = torch.randn(1, 6, 4, 1, 8)
    host = torch.zeros(1, 3, 4, 1, 8)
    attention.swap_blocks(device, host, torch.tensor([[4, 0], [1, 2]]))
    assert torch.equal(host[:, 0], device[:, 4]) and torch.equal(host[:, 2], device[:, 1])
    attention.copy_blocks([device], torch.tensor([[0, 5]]))
    assert torch.equal(device[:, 5], device[:, 0])
    with pytest.raises(ValueError, match=r"they may differ only in num_blocks"):
        attention.swap_blocks(device, torch.zeros(2, 3, 4, 1, 8), torch.tensor([[0, 0]]))


@pytest.mark.parametrize("isa", cpu_decode.ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_native_kernel_attends_deepseeks_latent_decode_rows(isa: str, dtype) -> None:
    """The CPU decode kernel over DeepSeek's 576 / 512 latent: every decode row it attends (the
    prefill chunks of the step stay on the torch path) equals the float64 reference."""
    skip_unless_native(isa)
    query, cache, metadata, v_dim, scale = _latent_batch("deepseek", dtype)
    assert cpu_decode.native_decode_covers(query, cache, v_dim, isa)
    kernel = functools.partial(native_decode, isa=isa)  # raises if it declines
    got = attention.paged_attention(
        query, cache, metadata, scale, v_head_dim=v_dim, decode_kernel=kernel
    )
    expected = naive_paged_attention(query, cache, metadata, scale, v_head_dim=v_dim)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


def test_the_native_kernel_declines_latent_dims_it_is_not_built_for() -> None:
    """A latent of other sizes (a head dim the kernel has for K/V caches, values fewer) goes to
    the torch path."""
    skip_unless_native()
    query, cache, metadata = paged_batch(
        [1, 1], [40, 9], num_heads=4, num_kv_heads=1, head_dim=64, planes=1
    )
    _, kv_cache, _ = paged_batch([1, 1], [40, 9], num_heads=4, num_kv_heads=1, head_dim=64)
    assert cpu_decode.native_decode_covers(query, kv_cache)
    assert not cpu_decode.native_decode_covers(query, cache, 48)
    assert not cpu_decode.native_decode_covers(query, cache, 64)
    got = attention.paged_attention(
        query, cache, metadata, 0.125, v_head_dim=48, decode_kernel=cpu_decode.attend_decode
    )  # asked, it declines without writing
    expected = naive_paged_attention(query, cache, metadata, 0.125, v_head_dim=48)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
