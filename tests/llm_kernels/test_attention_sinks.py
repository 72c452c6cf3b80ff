"""Attention sinks (gpt-oss: a learned logit per query head in every softmax's denominator, with
no value) in every attention path (torch, torch with the native CPU decode kernel, and Triton
through its interpreter without CUDA), against a dense float32 reference written the way HF
transformers' ``eager_attention_forward`` for gpt-oss computes it."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from llm_kernels import attention, cpu_decode, triton_attention
from llm_kernels.attention_metadata import AttentionMetadata
from tests.llm_kernels.native_cpu import native_paged_attention, skip_unless_native
from tests.llm_kernels.triton_batches import paged_batch

BACKENDS = [
    pytest.param(attention.paged_attention, id="torch"),
    pytest.param(native_paged_attention, id="cpu"),
    pytest.param(triton_attention.paged_attention, id="triton"),
]
FP32_TOLERANCE = 1e-5
# bf16 outputs against the float32 reference of the same bf16 inputs: one rounding of the output,
# plus, under the Triton interpreter, its truncating float32 -> bf16 casts.
BF16_TOLERANCE = 4e-2
SCALE = 32**-0.5
# A mixed batch: decodes (one of a one-token context), a prompt from position 0 that crosses a
# Triton query tile, and a chunk continuing a cached prefix (positions 32..44).
MIXED = ([1, 20, 13, 1, 1], [33, 20, 45, 1, 130])


def hf_sink_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """float32 ``[num_tokens, num_heads, head_dim]``, one request at a time as HF does: dense
    scores over the request's keys (repeated per query head), masked, the sink appended as one
    more column, softmax after subtracting the row max, the sink's column dropped, times V."""
    num_heads = query.shape[1]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    kv_head_of = torch.arange(num_heads) // (num_heads // num_kv_heads)
    out = torch.empty(query.shape, dtype=torch.float32)
    starts = metadata.query_start_loc.tolist()
    for b, seq_len in enumerate(metadata.seq_lens.tolist()):
        blocks = metadata.block_table[b, : math.ceil(seq_len / block_size)].tolist()
        keys, values = (
            torch.cat([kv_cache[plane, blk] for blk in blocks])[:seq_len, kv_head_of]
            .float()
            .transpose(0, 1)
            for plane in (0, 1)
        )  # [num_heads, seq_len, head_dim]
        rows = slice(starts[b], starts[b + 1])
        q = query[rows].float().transpose(0, 1)  # [num_heads, query_len, head_dim]
        query_len = q.shape[1]
        scores = torch.matmul(q, keys.transpose(1, 2)) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        sink_column = sinks.float().view(num_heads, 1, 1).expand(num_heads, query_len, 1)
        logits = torch.cat([scores, sink_column], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        out[rows] = torch.matmul(probs, values).transpose(0, 1)
    return out


def sinks_of(num_heads: int, *values: float, seed: int = 1) -> torch.Tensor:
    """float32 ``[num_heads]``: ``values`` first, then random logits of the size gpt-oss has."""
    random = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
    return torch.cat([torch.tensor(values, dtype=torch.float32), random])[:num_heads]


def assert_matches_hf(
    paged_attention: Callable[..., torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor, AttentionMetadata],
    sinks: torch.Tensor,
    tol: float = FP32_TOLERANCE,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    **kwargs: object,
) -> torch.Tensor:
    query, kv_cache, metadata = batch
    options = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
    out = paged_attention(query, kv_cache, metadata, SCALE, sinks=sinks, **options, **kwargs)
    expected = hf_sink_attention(
        query, kv_cache, metadata, SCALE, sinks, sliding_window, logits_soft_cap
    )
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_full_attention_with_sinks_matches_hf(paged_attention):
    batch = paged_batch(*MIXED, num_heads=8, num_kv_heads=2, head_dim=32)
    assert_matches_hf(paged_attention, batch, sinks_of(8))


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_sliding_window_shorter_than_the_context_with_sinks_matches_hf(paged_attention):
    # gpt-oss alternates windowed and full layers over one step's metadata; the window starts
    # inside the continued chunk's cached prefix and inside the long decode's last blocks.
    batch = paged_batch(*MIXED, num_heads=8, num_kv_heads=2, head_dim=32)
    assert_matches_hf(paged_attention, batch, sinks_of(8), sliding_window=8)


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_large_sinks_dominate_or_vanish(paged_attention):
    """A sink far above every score takes all the weight (output ~0); one far below takes none
    (output of attention without sinks)."""
    query, kv_cache, metadata = batch = paged_batch(
        *MIXED, num_heads=8, num_kv_heads=2, head_dim=32
    )
    sinks = sinks_of(8, 60.0, -60.0, 20.0, -20.0, 6.0, -6.0, 0.0)
    for window in (None, 8):
        out = assert_matches_hf(paged_attention, batch, sinks, sliding_window=window)
        plain = paged_attention(query, kv_cache, metadata, SCALE, sliding_window=window)
        assert out[:, 0].abs().max() < 1e-20
        torch.testing.assert_close(out[:, 1], plain[:, 1], atol=1e-6, rtol=1e-6)
        # A sink near the scores changes the output.
        assert (out[:, 6] - plain[:, 6]).abs().max() > 1e-2


@pytest.mark.parametrize("paged_attention", BACKENDS)
@pytest.mark.parametrize("window", [None, 8], ids=["full", "window"])
def test_sinks_in_bfloat16(paged_attention, window):
    batch = paged_batch(
        [1, 10, 1], [40, 25, 3], num_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16
    )
    assert_matches_hf(
        paged_attention, batch, sinks_of(8, 3.0, -3.0), BF16_TOLERANCE, sliding_window=window
    )


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_sinks_with_window_and_soft_cap_together(paged_attention):
    batch = paged_batch([1, 9, 1], [60, 30, 7], num_heads=4, num_kv_heads=2, head_dim=32)
    assert_matches_hf(paged_attention, batch, sinks_of(4), sliding_window=12, logits_soft_cap=3.0)


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_sinks_given_in_bfloat16_are_read_in_float32(paged_attention):
    """A model cast to bf16 casts its sinks parameter too; the kernels widen it."""
    batch = paged_batch([1, 6], [30, 6], num_heads=4, num_kv_heads=4, head_dim=32)
    sinks = sinks_of(4).to(torch.bfloat16)
    assert_matches_hf(paged_attention, batch, sinks)


@pytest.mark.parametrize("num_kv_splits", [2, 5])
@pytest.mark.parametrize("window", [None, 20], ids=["full", "window"])
def test_triton_split_kv_counts_each_sink_once(num_kv_splits, window):
    # 5 splits of a one-token context (or of a 20-key window) leave splits empty; the sink is
    # counted by the first, which always holds keys, and the merge must weigh it once.
    batch = paged_batch([1, 1, 1], [300, 1, 47], num_heads=8, num_kv_heads=2, head_dim=32)
    assert_matches_hf(
        triton_attention.paged_attention,
        batch,
        sinks_of(8, 4.0, -4.0),
        sliding_window=window,
        num_kv_splits=num_kv_splits,
    )


def test_torch_sinked_prefill_attended_in_slices_of_query_rows(monkeypatch):
    # Scores for 5 query rows at a time (8 heads x 45 keys each): several slices per chunk.
    monkeypatch.setattr(attention, "_EXPLICIT_MAX_SCORES", 5 * 8 * 45)
    batch = paged_batch(*MIXED, num_heads=8, num_kv_heads=2, head_dim=32)
    for window in (None, 8):
        assert_matches_hf(attention.paged_attention, batch, sinks_of(8), sliding_window=window)


@pytest.mark.parametrize("isa", cpu_decode.ISAS)
def test_native_decode_kernel_with_sinks_in_each_build(isa):
    # Head dim 64 and G = 8 (more query heads than one AVX2 register tile); contexts shorter
    # than a vector, within one block and over several.
    skip_unless_native(isa)
    batch = paged_batch([1] * 4, [1, 9, 40, 300], num_heads=16, num_kv_heads=2, head_dim=64)
    sinks = sinks_of(16, 30.0, -30.0)
    for window in (None, 24):
        assert_matches_hf(
            lambda *args, **kwargs: native_paged_attention(*args, isa=isa, **kwargs),
            batch,
            sinks,
            sliding_window=window,
        )


@pytest.mark.parametrize("paged_attention", BACKENDS)
@pytest.mark.parametrize(
    ("sinks", "match"),
    [
        (torch.zeros(5), r"sinks must be None or a tensor of shape \[4\] \(num_heads\), got \[5\]"),
        (torch.zeros(1, 4), r"sinks must be None or a tensor of shape \[4\] .*got \[1, 4\]"),
        ([0.0] * 4, r"sinks must be None or a tensor of shape \[4\] .*got list"),
        (torch.zeros(4, dtype=torch.int64), r"sinks must be a floating-point tensor"),
        (torch.zeros(4, device="meta"), r"sinks is on meta but query is on cpu"),
    ],
    ids=["too-many", "2-d", "list", "integer", "other-device"],
)
def test_rejects_malformed_sinks_by_name(paged_attention, sinks, match):
    query, kv_cache, metadata = paged_batch([1], [4], num_heads=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match=match):
        paged_attention(query, kv_cache, metadata, SCALE, sinks=sinks)


def test_triton_latent_cache_refuses_sinks():
    query, kv_cache, metadata = paged_batch(
        [1], [4], num_heads=4, num_kv_heads=1, head_dim=32, planes=1
    )
    with pytest.raises(ValueError, match="without sliding_window, soft cap or sinks"):
        triton_attention.paged_attention(
            query, kv_cache, metadata, SCALE, v_head_dim=16, sinks=torch.zeros(4)
        )
