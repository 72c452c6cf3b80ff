"""Sliding-window attention and logit soft-capping, in every attention path (torch, torch with
the native CPU decode kernel, and Triton through its interpreter without CUDA), against the
naive float64 reference of tests/llm_kernels/naive_attention.py."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from llm_kernels import attention, triton_attention
from llm_kernels.attention_metadata import AttentionMetadata
from llm_kernels.triton_common import choose_num_kv_splits
from tests.llm_kernels.naive_attention import naive_paged_attention
from tests.llm_kernels.native_cpu import native_paged_attention
from tests.llm_kernels.triton_batches import paged_batch

BACKENDS = [
    pytest.param(attention.paged_attention, id="torch"),
    pytest.param(native_paged_attention, id="cpu"),
    pytest.param(triton_attention.paged_attention, id="triton"),
]
# fp32 outputs against the float64 reference.
FP32_TOLERANCE = 2e-6
SCALE = 0.25  # larger than head_dim ** -0.5, so that a soft cap of a few units bites


def assert_matches_naive(
    paged_attention: Callable[..., torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor, AttentionMetadata],
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    tol: float = FP32_TOLERANCE,
    **kwargs: object,
) -> torch.Tensor:
    query, kv_cache, metadata = batch
    out = paged_attention(
        query,
        kv_cache,
        metadata,
        SCALE,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        **kwargs,
    )
    expected = naive_paged_attention(
        query, kv_cache, metadata, SCALE, sliding_window, logits_soft_cap
    )
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_window_shorter_than_the_prompt(paged_attention):
    # Prompts from position 0 longer than the window (one crossing a Triton query tile), and
    # decodes whose context is longer than it.
    batch = paged_batch([40, 1, 70, 1], [40, 50, 70, 9], num_heads=4, num_kv_heads=2, head_dim=32)
    assert_matches_naive(paged_attention, batch, sliding_window=8)


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_window_of_one_returns_each_token_own_value(paged_attention):
    batch = paged_batch([1, 6, 1], [20, 6, 1], num_heads=4, num_kv_heads=2, head_dim=32)
    _, kv_cache, metadata = batch
    out = assert_matches_naive(paged_attention, batch, sliding_window=1)
    # The only visible key is the token's own: softmax weight 1 on its value.
    for b, (row, position) in enumerate([(0, 19), (6, 5), (7, 0)]):
        slot = metadata.block_table[b, position // 16] * 16 + position % 16
        own_value = kv_cache[1].view(-1, 2, 32)[slot]
        torch.testing.assert_close(out[row], own_value.repeat_interleave(2, dim=0))


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_window_covering_every_context_equals_no_window(paged_attention):
    query, kv_cache, metadata = paged_batch(
        [1, 12, 1], [30, 12, 45], num_heads=4, num_kv_heads=2, head_dim=32
    )
    plain = paged_attention(query, kv_cache, metadata, SCALE)
    for window in (45, 46, 1 << 20):
        windowed = paged_attention(query, kv_cache, metadata, SCALE, sliding_window=window)
        torch.testing.assert_close(windowed, plain, atol=0, rtol=0)


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_chunks_starting_mid_sequence_with_a_window(paged_attention):
    # Chunks continuing a cached prefix: window start inside the prefix, at a block boundary,
    # and inside the chunk's own first block.
    batch = paged_batch([13, 20, 5], [45, 52, 100], num_heads=4, num_kv_heads=2, head_dim=32)
    for window in (10, 33, 3):
        assert_matches_naive(paged_attention, batch, sliding_window=window)


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_decodes_of_mixed_lengths_with_a_window(paged_attention):
    # Lengths below, at and far above the window, in several torch decode groups.
    batch = paged_batch(
        [1] * 7, [1, 5, 17, 20, 21, 130, 400], num_heads=4, num_kv_heads=2, head_dim=32
    )
    assert_matches_naive(paged_attention, batch, sliding_window=20)


@pytest.mark.parametrize("paged_attention", BACKENDS)
@pytest.mark.parametrize("num_heads", [4, 8], ids=["gqa2", "gqa4"])
def test_grouped_query_heads_with_window_and_soft_cap(paged_attention, num_heads):
    batch = paged_batch([1, 9, 1], [60, 30, 7], num_heads=num_heads, num_kv_heads=2, head_dim=32)
    assert_matches_naive(paged_attention, batch, sliding_window=12, logits_soft_cap=3.0)


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_soft_cap_alone(paged_attention):
    query, kv_cache, metadata = batch = paged_batch(
        [1, 24, 1, 3], [50, 24, 3, 40], num_heads=4, num_kv_heads=2, head_dim=32
    )
    capped = assert_matches_naive(paged_attention, batch, logits_soft_cap=2.0)
    # The cap is not a no-op at this scale: the uncapped output differs.
    plain = paged_attention(query, kv_cache, metadata, SCALE)
    assert (capped - plain).abs().max() > 0.05


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_soft_cap_and_window_together_on_a_mixed_batch(paged_attention):
    batch = paged_batch(
        [1, 20, 13, 1, 1], [33, 20, 45, 1, 200], num_heads=4, num_kv_heads=2, head_dim=32
    )
    assert_matches_naive(paged_attention, batch, sliding_window=16, logits_soft_cap=5.0)


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_soft_cap_in_bfloat16(paged_attention):
    batch = paged_batch(
        [1, 10], [40, 25], num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16
    )
    assert_matches_naive(paged_attention, batch, sliding_window=9, logits_soft_cap=2.0, tol=4e-2)


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_keys_in_blocks_wholly_before_the_window_are_never_read(paged_attention):
    """NaN in every block that lies before the window of a long decode and of a long chunk's
    first query, rounded down to 64 positions (a Triton key tile): nothing may read them."""
    query, kv_cache, metadata = paged_batch(
        [1, 8], [1000, 700], num_heads=4, num_kv_heads=2, head_dim=32
    )
    window = 100
    first_keys = [1000 - window, 700 - 8 - window + 1]
    for b, first_key in enumerate(first_keys):
        for logical in range(first_key // 64 * 64 // 16):
            kv_cache[:, metadata.block_table[b, logical]] = float("nan")
    out = assert_matches_naive(paged_attention, (query, kv_cache, metadata), window, 4.0)
    assert out.isfinite().all()


@pytest.mark.parametrize("num_kv_splits", [2, 5])
def test_triton_split_kv_splits_the_window_range(num_kv_splits):
    # 5 splits of a 20-key window leave most splits empty; they must not perturb the merge.
    batch = paged_batch([1, 1, 1], [300, 1, 47], num_heads=4, num_kv_heads=2, head_dim=32)
    assert_matches_naive(
        triton_attention.paged_attention,
        batch,
        sliding_window=20,
        logits_soft_cap=3.0,
        num_kv_splits=num_kv_splits,
    )


def test_split_kv_counts_only_the_keys_inside_the_window():
    _, _, metadata = paged_batch([1], [4096], num_heads=4, num_kv_heads=2, head_dim=16)
    assert choose_num_kv_splits(metadata, num_kv_heads=2) > 1
    assert choose_num_kv_splits(metadata, num_kv_heads=2, sliding_window=256) == 1


def test_torch_windowed_decode_gathers_only_the_window_blocks():
    _, _, metadata = paged_batch(
        [1, 1, 1, 5], [3000, 2000, 10, 900], num_heads=4, num_kv_heads=2, head_dim=16
    )
    window, block_size = 100, 16
    plan = metadata.window_plan(window)
    most_blocks = math.ceil((window - 1) / block_size) + 1
    assert sum(g.num_seqs for g in plan.decode_groups) == 3
    for group in plan.decode_groups:
        assert group.max_blocks <= most_blocks
        assert group.block_ids.numel() == group.num_seqs * group.max_blocks
    # The chunk's first query (position 895) sees keys from 796 on, in block 49.
    (chunk,) = plan.prefill_chunks
    assert chunk.key_start == 49 * block_size
    assert chunk.block_ids.numel() == math.ceil(900 / block_size) - 49
    assert metadata.window_plan(window) is plan


def test_torch_soft_capped_prefill_attended_in_slices_of_query_rows(monkeypatch):
    # Scores for 5 query rows at a time (4 heads x 40 keys each): several slices per chunk.
    monkeypatch.setattr(attention, "_EXPLICIT_MAX_SCORES", 5 * 4 * 40)
    batch = paged_batch([1, 23, 17], [40, 23, 40], num_heads=4, num_kv_heads=2, head_dim=32)
    assert_matches_naive(attention.paged_attention, batch, sliding_window=9, logits_soft_cap=3.0)
    assert_matches_naive(attention.paged_attention, batch, logits_soft_cap=3.0)


def test_layers_with_different_windows_share_one_metadata():
    """Gemma 2 alternates windowed and global layers over one step's metadata."""
    batch = paged_batch([1, 30, 1], [90, 45, 7], num_heads=4, num_kv_heads=2, head_dim=32)
    metadata = batch[2]
    for window, soft_cap in [(8, 4.0), (None, 4.0), (20, None), (8, None), (None, None)]:
        assert_matches_naive(attention.paged_attention, batch, window, soft_cap)
    assert set(metadata.window_plans) == {8, 20}


@pytest.mark.parametrize("paged_attention", BACKENDS)
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sliding_window": 0}, r"sliding_window must be None or an int >= 1, got 0"),
        ({"sliding_window": 2.5}, r"sliding_window must be None or an int >= 1, got 2\.5"),
        ({"sliding_window": True}, r"sliding_window must be None or an int >= 1, got True"),
        ({"logits_soft_cap": 0.0}, r"logits_soft_cap must be None or a finite float > 0"),
        ({"logits_soft_cap": -30.0}, r"logits_soft_cap must be None or a finite float > 0"),
        ({"logits_soft_cap": math.inf}, r"logits_soft_cap must be None or a finite float > 0"),
        ({"logits_soft_cap": math.nan}, r"logits_soft_cap must be None or a finite float > 0"),
    ],
    ids=["window0", "window-float", "window-bool", "cap0", "cap-negative", "cap-inf", "cap-nan"],
)
def test_rejects_out_of_range_window_and_soft_cap(paged_attention, kwargs, match):
    query, kv_cache, metadata = paged_batch([1], [4], num_heads=2, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match=match):
        paged_attention(query, kv_cache, metadata, SCALE, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_gpu_gemma2_like_batches_match_the_torch_path(dtype, tol):
    """Gemma 2's heads (head_dim 256, GQA 2) with its window and cap, at realistic lengths: a
    mixed batch, and two long decodes that take the split-KV path."""
    generator = torch.Generator().manual_seed(0)
    decode_lens = torch.randint(1, 6000, (16,), generator=generator).tolist()
    mixed = ([1] * 16 + [300, 77], [*decode_lens, 2300, 1000])
    long_decodes = ([1, 1], [8192, 5000])
    for query_lens, seq_lens in (mixed, long_decodes):
        query, kv_cache, metadata = paged_batch(
            query_lens,
            seq_lens,
            num_heads=16,
            num_kv_heads=8,
            head_dim=256,
            dtype=dtype,
            device="cuda",
        )
        for window, soft_cap in [(4096, 50.0), (4096, None), (None, 50.0)]:
            out = triton_attention.paged_attention(
                query, kv_cache, metadata, 0.0625, window, soft_cap
            )
            expected = attention.paged_attention(
                query, kv_cache, metadata, 0.0625, window, soft_cap
            )
            torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
