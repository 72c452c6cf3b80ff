"""llm_kernels.triton_attention.paged_attention against the torch paged attention (the reference).

Without CUDA these run through the Triton interpreter (see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from llm_kernels import attention
from llm_kernels.triton_attention import paged_attention
from llm_kernels.triton_common import choose_num_kv_splits
from tests.llm_kernels.triton_batches import paged_batch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# Under the interpreter, float32 -> bfloat16 casts truncate instead of rounding to nearest,
# which costs bf16 outputs up to one more unit in the last place.
INTERPRETER_BF16_TOLERANCE = 4e-2


def assert_matches_reference(query, kv_cache, metadata, *, num_kv_splits=None) -> None:
    scale = query.shape[-1] ** -0.5
    out = paged_attention(query, kv_cache, metadata, scale, num_kv_splits=num_kv_splits)
    expected = attention.paged_attention(query, kv_cache, metadata, scale)
    tol = TOLERANCE[query.dtype]
    if query.dtype == torch.bfloat16 and query.device.type == "cpu":
        tol = INTERPRETER_BF16_TOLERANCE
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("seq_len", [1, 15, 17, 40])
def test_decode_matches_reference_for_context_lengths_around_block_boundaries(seq_len):
    batch = paged_batch([1], [seq_len], num_heads=4, num_kv_heads=2, head_dim=64)
    assert_matches_reference(*batch)


@pytest.mark.parametrize("num_heads", [2, 8, 16])
def test_gqa_ratios_1_4_8_match_reference(num_heads):
    batch = paged_batch([1, 3], [21, 35], num_heads=num_heads, num_kv_heads=2, head_dim=64)
    assert_matches_reference(*batch)


def test_mqa_single_kv_head_matches_reference():
    batch = paged_batch([1, 4], [9, 30], num_heads=8, num_kv_heads=1, head_dim=64)
    assert_matches_reference(*batch)


def test_mixed_decode_and_prefill_batch_matches_reference():
    # decode, full prompt, a chunk continuing a cached prefix across blocks, decode of length 1
    batch = paged_batch([1, 20, 13, 1], [33, 20, 45, 1], num_heads=4, num_kv_heads=2, head_dim=64)
    assert_matches_reference(*batch)


def test_prefill_chunk_longer_than_one_query_tile_matches_reference():
    batch = paged_batch([70], [90], num_heads=2, num_kv_heads=2, head_dim=32)
    assert_matches_reference(*batch)


@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
def test_head_dims_including_non_powers_of_two_match_reference(head_dim):
    batch = paged_batch([1, 3], [19, 6], num_heads=2, num_kv_heads=1, head_dim=head_dim)
    assert_matches_reference(*batch)


def test_block_size_32_matches_reference():
    batch = paged_batch([1, 5], [70, 40], num_heads=4, num_kv_heads=2, head_dim=64, block_size=32)
    assert_matches_reference(*batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches_match_reference(dtype):
    batch = paged_batch([1, 6], [37, 22], num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype)
    assert_matches_reference(*batch)


@pytest.mark.parametrize("num_kv_splits", [2, 3, 8])
def test_split_kv_decode_matches_reference(num_kv_splits):
    # 8 splits of a 1-token context leave most splits empty; they must not perturb the merge.
    batch = paged_batch([1, 1, 1], [100, 1, 47], num_heads=4, num_kv_heads=2, head_dim=64)
    assert_matches_reference(*batch, num_kv_splits=num_kv_splits)


def test_split_kv_is_chosen_for_few_long_decodes_only():
    _, _, long_decode = paged_batch([1], [4096], num_heads=4, num_kv_heads=2, head_dim=16)
    _, _, with_prefill = paged_batch([1, 2], [4096, 2], num_heads=4, num_kv_heads=2, head_dim=16)
    _, _, short = paged_batch([1], [100], num_heads=4, num_kv_heads=2, head_dim=16)
    assert choose_num_kv_splits(long_decode, num_kv_heads=2) > 1
    assert choose_num_kv_splits(with_prefill, num_kv_heads=2) == 1
    assert choose_num_kv_splits(short, num_kv_heads=2) == 1


def test_output_is_contiguous_when_query_is_a_strided_view():
    query, kv_cache, metadata = paged_batch(
        [2, 1], [5, 18], num_heads=4, num_kv_heads=2, head_dim=64
    )
    wide = torch.cat([query, torch.zeros_like(query)], dim=1)[:, :4]  # stride(0) = 8 * 64
    out = paged_attention(wide, kv_cache, metadata, 0.125)
    assert out.is_contiguous()
    torch.testing.assert_close(out, attention.paged_attention(query, kv_cache, metadata, 0.125))


def test_rejects_heads_not_a_multiple_of_kv_heads():
    query, kv_cache, metadata = paged_batch([1], [4], num_heads=3, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(query, kv_cache, metadata, 0.125)


def test_rejects_query_dtype_different_from_cache():
    query, kv_cache, metadata = paged_batch([1], [4], num_heads=2, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match=r"query has dtype torch\.float16"):
        paged_attention(query.half(), kv_cache, metadata, 0.125)


def test_rejects_out_of_range_split_count():
    query, kv_cache, metadata = paged_batch([1], [4], num_heads=2, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match=r"num_kv_splits must be an int in \[1, 64\]"):
        paged_attention(query, kv_cache, metadata, 0.125, num_kv_splits=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_gpu_realistic_mixed_batch_matches_reference(dtype, head_dim):
    query_lens = [1] * 48 + [512, 300, 77]
    seq_lens = [int(x) for x in torch.randint(1, 4000, (48,))] + [512, 2300, 1000]
    batch = paged_batch(
        query_lens,
        seq_lens,
        num_heads=32,
        num_kv_heads=8,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
    )
    assert_matches_reference(*batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_split_kv_long_context_matches_reference():
    batch = paged_batch(
        [1, 1],
        [8192, 5000],
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
        block_size=32,
    )
    assert choose_num_kv_splits(batch[2], num_kv_heads=8) > 1
    assert_matches_reference(*batch)
