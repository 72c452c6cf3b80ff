"""llm_kernels.triton_mla (multi-head latent attention over a one-plane latent cache) against the
torch paged attention over the same cache (the reference), which itself equals the float64
naive reference (tests/llm_kernels/test_latent_attention.py).

Without CUDA these run through the Triton interpreter (see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from llm_kernels import attention, triton_attention, triton_cache
from llm_kernels.kv_quant import quantize_kv
from llm_kernels.triton_mla import paged_latent_attention
from tests.llm_kernels.triton_batches import paged_batch

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-2}  # bf16: the interpreter's truncation
# DeepSeek-V3's latent (512 + 64) over 16 of its heads; a tiny one (32 + 8) over 4 heads; 20
# heads, more than one program's 16, with an uneven split of the head dim.
SHAPES = {"deepseek": (16, 576, 512), "tiny": (4, 40, 32), "20-heads": (20, 72, 48)}


def _check(query_lens, seq_lens, shape, dtype=torch.float32, block_size=16, **kwargs) -> None:
    heads, dim, v_dim = SHAPES[shape]
    query, cache, metadata = paged_batch(
        query_lens, seq_lens, num_heads=heads, num_kv_heads=1, head_dim=dim,
        block_size=block_size, dtype=dtype, planes=1,
    )  # fmt: skip
    scale = 0.1
    got = paged_latent_attention(query, cache, metadata, scale, v_dim, **kwargs)
    expected = attention.paged_attention(query, cache, metadata, scale, v_head_dim=v_dim)
    assert got.shape == (query.shape[0], heads, v_dim) and got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_rows_of_uneven_lengths_match_the_torch_path(shape: str, block_size: int) -> None:
    _check([1, 1, 1, 1], [1, 17, 40, 33], shape, block_size=block_size)


@pytest.mark.parametrize("shape", ["tiny", "20-heads"])
def test_decode_and_prefill_chunks_in_one_step_match_the_torch_path(shape: str) -> None:
    # A decode, a whole prompt, a chunk continuing a cached prefix across blocks.
    _check([1, 20, 13], [33, 20, 45], shape)


@pytest.mark.parametrize("shape", ["deepseek", "tiny"])
def test_bf16_matches_the_torch_path(shape: str) -> None:
    _check([1, 1, 6], [25, 9, 6], shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("num_kv_splits", [2, 3])
def test_split_keys_merge_to_the_torch_path(num_kv_splits: int) -> None:
    _check([1, 1], [64, 7], "20-heads", num_kv_splits=num_kv_splits)


def test_fp8_cache_dequantized_with_k_scale_matches_the_torch_path() -> None:
    heads, dim, v_dim = SHAPES["tiny"]
    query, cache, metadata = paged_batch(
        [1, 5], [30, 12], num_heads=heads, num_kv_heads=1, head_dim=dim, planes=1
    )
    fp8 = quantize_kv(cache, 0.04)
    got = paged_latent_attention(query, fp8, metadata, 0.1, v_dim, 0.04)
    expected = attention.paged_attention(query, fp8, metadata, 0.1, k_scale=0.04, v_head_dim=v_dim)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_triton_backend_dispatches_a_latent_cache_and_writes_it() -> None:
    heads, dim, v_dim = SHAPES["tiny"]
    query, cache, metadata = paged_batch(
        [1, 3], [9, 3], num_heads=heads, num_kv_heads=1, head_dim=dim, planes=1
    )
    got = triton_attention.paged_attention(query, cache, metadata, 0.1, v_head_dim=v_dim)
    torch.testing.assert_close(got, paged_latent_attention(query, cache, metadata, 0.1, v_dim))
    with pytest.raises(ValueError, match="without sliding_window"):
        triton_attention.paged_attention(
            query, cache, metadata, 0.1, sliding_window=4, v_head_dim=v_dim
        )
    latent = torch.randn(3, 1, dim)
    torch_cache, triton_cache_ = torch.zeros(1, 2, 16, 1, dim), torch.zeros(1, 2, 16, 1, dim)
    slots = torch.tensor([0, -1, 17])
    attention.reshape_and_cache(latent, None, torch_cache, slots)
    triton_cache.reshape_and_cache(latent, None, triton_cache_, slots)
    assert torch.equal(torch_cache, triton_cache_)
    triton_cache.copy_blocks([triton_cache_], torch.tensor([[1, 0]]))
    assert torch.equal(triton_cache_[:, 0], torch_cache[:, 1])
