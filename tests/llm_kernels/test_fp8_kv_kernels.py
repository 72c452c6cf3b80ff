"""The FP8 KV cache in every attention path, against a dequantizing reference.

The reference for attention over an FP8 cache is the same attention over the cache
dequantized in plain torch (``float32(q) * scale`` cast to the query's dtype): the torch path
must equal it exactly (it attends the very same values) and a float64 naive attention closely;
the Triton kernels (interpreter on CPU) must write the same bytes as the torch cache write and
attend within the tolerances of their unquantized tests. Shapes are small: every Triton call
here runs through the interpreter in a second or less."""

from __future__ import annotations

import pytest
import torch

from llm_kernels import attention, triton_attention, triton_cache
from llm_kernels.kv_quant import FP8_DTYPE, dequantize_kv, kv_cache_torch_dtype, quantize_kv
from tests.llm_kernels.naive_attention import naive_paged_attention
from tests.llm_kernels.triton_batches import paged_batch

SCALES = [(1.0, 1.0), (0.5, 2.0), (0.37, 1.3)]


def fp8_batch(query_lens, seq_lens, *, k_scale, v_scale, dtype=torch.float32, **shape):
    """(query, fp8 cache, the cache dequantized into ``dtype``, metadata); K/V drawn at about
    40x the scale so that some values saturate at +-448 * scale."""
    query, kv, metadata = paged_batch(query_lens, seq_lens, dtype=torch.float32, **shape)
    fp8 = torch.stack(
        [quantize_kv(kv[0] * 40 * k_scale, k_scale), quantize_kv(kv[1] * 40 * v_scale, v_scale)]
    )
    dequantized = torch.stack(
        [dequantize_kv(fp8[0], k_scale, dtype), dequantize_kv(fp8[1], v_scale, dtype)]
    )
    return query.to(dtype) / 40, fp8, dequantized, metadata


def test_quantize_saturates_rounds_to_nearest_even_and_dequantizes_with_the_scale():
    x = torch.tensor([1000.0, -1000.0, 1.0625, 1.1875, 0.3, -0.0019, 0.0])
    q = quantize_kv(x, 1.0)
    assert q.dtype == FP8_DTYPE
    # 1.0625 is halfway between 1.0 and 1.125: ties go to the even mantissa (1.0).
    assert q.float().tolist()[:4] == [448.0, -448.0, 1.0, 1.25]
    assert torch.equal(quantize_kv(x * 0.5, 0.5).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(dequantize_kv(q, 0.5, torch.float32), q.float() * 0.5)
    assert kv_cache_torch_dtype("fp8_e4m3", torch.bfloat16) == FP8_DTYPE
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of auto, fp8, fp8_e4m3"):
        kv_cache_torch_dtype("int8", torch.float32)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("write", [attention.reshape_and_cache, triton_cache.reshape_and_cache])
def test_cache_write_stores_quantized_bytes_and_skips_negative_slots(write, k_scale, v_scale):
    kv = torch.zeros(2, 4, 16, 2, 40, dtype=FP8_DTYPE)
    key, value = torch.randn(5, 2, 40) * 300, torch.randn(5, 2, 40)
    slots = torch.tensor([5, -1, 40, 63, 16])
    write(key, value, kv, slots, k_scale=k_scale, v_scale=v_scale)
    flat = kv.view(torch.uint8).view(2, -1, 2, 40)
    keep = slots >= 0
    assert torch.equal(flat[0, slots[keep]], quantize_kv(key[keep], k_scale).view(torch.uint8))
    assert torch.equal(flat[1, slots[keep]], quantize_kv(value[keep], v_scale).view(torch.uint8))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert not flat[:, untouched].any()


def test_triton_cache_write_matches_torch_for_half_precision_inputs():
    kv, expected = (torch.zeros(2, 3, 16, 4, 64, dtype=FP8_DTYPE) for _ in range(2))
    key, value = (torch.randn(20, 4, 64).to(torch.bfloat16) for _ in range(2))
    slots = torch.randperm(48)[:20]
    triton_cache.reshape_and_cache(key, value, kv, slots, k_scale=0.02, v_scale=0.7)
    attention.reshape_and_cache(key, value, expected, slots, k_scale=0.02, v_scale=0.7)
    assert torch.equal(kv.view(torch.uint8), expected.view(torch.uint8))


# (query_lens, seq_lens, options): decode, full prompts, chunked prefill continuing a cached
# prefix, GQA and MQA, a sliding window, a soft cap.
CASES = {
    "decode": ([1, 1, 1], [1, 17, 40], {}),
    "prefill": ([20, 9], [20, 9], {}),
    "chunked_prefix": ([1, 13, 1], [33, 45, 2], {}),
    "window": ([1, 12], [40, 50], {"sliding_window": 8}),
    "softcap": ([1, 7], [30, 25], {"logits_soft_cap": 5.0}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("k_scale,v_scale", SCALES[1:])
def test_torch_path_equals_attention_over_the_dequantized_cache(case, k_scale, v_scale):
    query_lens, seq_lens, options = CASES[case]
    for num_kv_heads in (2, 1):
        query, fp8, dequantized, meta = fp8_batch(
            query_lens, seq_lens, k_scale=k_scale, v_scale=v_scale,
            num_heads=4, num_kv_heads=num_kv_heads, head_dim=32,
        )  # fmt: skip
        got = attention.paged_attention(
            query, fp8, meta, 0.2, k_scale=k_scale, v_scale=v_scale, **options
        )
        torch.testing.assert_close(
            got, attention.paged_attention(query, dequantized, meta, 0.2, **options), atol=0, rtol=0
        )
        naive = naive_paged_attention(query, dequantized, meta, 0.2, **options)
        torch.testing.assert_close(got.double(), naive, atol=1e-5, rtol=1e-5)


def test_torch_path_dequantizes_into_the_query_dtype():
    query, fp8, dequantized, meta = fp8_batch(
        [1, 5], [19, 5], k_scale=0.3, v_scale=0.9, dtype=torch.bfloat16,
        num_heads=4, num_kv_heads=2, head_dim=32,
    )  # fmt: skip
    got = attention.paged_attention(query, fp8, meta, 0.2, k_scale=0.3, v_scale=0.9)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, attention.paged_attention(query, dequantized, meta, 0.2))


@pytest.mark.parametrize("case", list(CASES))
def test_triton_attention_over_fp8_matches_the_torch_path(case):
    query_lens, seq_lens, options = CASES[case]
    query, fp8, _, meta = fp8_batch(
        query_lens, seq_lens, k_scale=0.37, v_scale=1.3, num_heads=4, num_kv_heads=2, head_dim=32
    )
    got = triton_attention.paged_attention(
        query, fp8, meta, 0.2, k_scale=0.37, v_scale=1.3, **options
    )
    expected = attention.paged_attention(
        query, fp8, meta, 0.2, k_scale=0.37, v_scale=1.3, **options
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_triton_split_kv_over_fp8_bf16_matches_the_torch_path():
    query, fp8, _, meta = fp8_batch(
        [1, 1], [70, 33], k_scale=0.5, v_scale=0.25, dtype=torch.bfloat16,
        num_heads=4, num_kv_heads=2, head_dim=32,
    )  # fmt: skip
    got = triton_attention.paged_attention(
        query, fp8, meta, 0.2, k_scale=0.5, v_scale=0.25, num_kv_splits=3
    )
    expected = attention.paged_attention(query, fp8, meta, 0.2, k_scale=0.5, v_scale=0.25)
    torch.testing.assert_close(got.float(), expected.float(), atol=4e-2, rtol=4e-2)


@pytest.mark.parametrize("module", [attention, triton_cache])
def test_block_copies_and_swaps_move_fp8_bytes(module):
    kv = quantize_kv(torch.randn(2, 5, 16, 2, 32) * 10, 1.0)
    before = kv.view(torch.uint8).clone()
    module.copy_blocks([kv], torch.tensor([[0, 3], [1, 4]]))
    assert torch.equal(kv.view(torch.uint8)[:, [3, 4]], before[:, [0, 1]])
    host = torch.zeros(2, 3, 16, 2, 32, dtype=FP8_DTYPE)
    module.swap_blocks(kv, host, torch.tensor([[2, 0], [3, 2]]))
    assert torch.equal(host.view(torch.uint8)[:, [0, 2]], before[:, [2, 0]])


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), torch.ones(2)])
@pytest.mark.parametrize("write", [attention.reshape_and_cache, triton_cache.reshape_and_cache])
def test_bad_scales_are_refused_by_name(write, scale):
    kv = torch.zeros(2, 2, 16, 1, 8, dtype=FP8_DTYPE)
    key = torch.randn(1, 1, 8)
    with pytest.raises(ValueError, match="k_scale: must be"):
        write(key, key, kv, torch.tensor([0]), k_scale=scale)


def test_a_non_float_query_over_an_fp8_cache_is_refused():
    query, fp8, _, meta = fp8_batch(
        [1], [3], k_scale=1.0, v_scale=1.0, num_heads=2, num_kv_heads=2, head_dim=8
    )
    with pytest.raises(ValueError, match="query must be float16, bfloat16 or float32"):
        attention.paged_attention(query.to(torch.float64), fp8, meta, 0.2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fp8_cache_realistic_mixed_batch_matches_torch_path(dtype):
    query_lens = [1] * 48 + [512, 300, 77]
    seq_lens = [int(x) for x in torch.randint(1, 4000, (48,))] + [512, 2300, 1000]
    query, kv, meta = paged_batch(
        query_lens, seq_lens, num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype,
        device="cuda",
    )  # fmt: skip
    fp8 = torch.stack([quantize_kv(kv[0] * 10, 0.05), quantize_kv(kv[1] * 10, 0.02)])
    query = query * 0.1
    got = triton_attention.paged_attention(query, fp8, meta, 0.088, k_scale=0.05, v_scale=0.02)
    expected = attention.paged_attention(query, fp8, meta, 0.088, k_scale=0.05, v_scale=0.02)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    # The cache write on the GPU rounds exactly like torch's cast.
    cache = torch.zeros_like(fp8)
    key, value = kv[0, :8].reshape(-1, 8, 128) * 300, kv[1, :8].reshape(-1, 8, 128)
    slots = torch.arange(key.shape[0], device="cuda")
    triton_cache.reshape_and_cache(key, value, cache, slots, k_scale=0.7, v_scale=0.01)
    flat = cache.view(torch.uint8).view(2, -1, 8, 128)[:, : key.shape[0]]
    assert torch.equal(flat[0], quantize_kv(key, 0.7).view(torch.uint8))
    assert torch.equal(flat[1], quantize_kv(value, 0.01).view(torch.uint8))
