"""Spans of a prefill chunk attended both ways (Gemma 3's images: causal OR same span, and
within a sliding window on windowed layers), in the torch path and through the Triton
backend (which hands such steps to the torch path), against the naive float64 reference."""

from __future__ import annotations

import pytest
import torch

from llm_kernels import attention, triton_attention
from llm_kernels.attention_metadata import AttentionMetadata
from tests.llm_kernels.naive_attention import naive_paged_attention
from tests.llm_kernels.triton_batches import paged_batch

BACKENDS = [
    pytest.param(attention.paged_attention, id="torch"),
    pytest.param(triton_attention.paged_attention, id="triton"),
]
SCALE = 0.25


def _check(paged_attention, query_lens, seq_lens, spans, window=None) -> torch.Tensor:
    query, kv_cache, metadata = paged_batch(
        query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=32, bidirectional=spans
    )
    out = paged_attention(query, kv_cache, metadata, SCALE, sliding_window=window)
    expected = naive_paged_attention(
        query, kv_cache, metadata, SCALE, window, bidirectional=[list(s) for s in spans]
    )
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=2e-6)
    causal = naive_paged_attention(query, kv_cache, metadata, SCALE, window)
    return (out.double() - causal).abs().amax(dim=(1, 2))  # per row: how far from causal


@pytest.mark.parametrize("paged_attention", BACKENDS)
@pytest.mark.parametrize("window", [None, 6, 40])
def test_one_span_in_a_prompt_from_position_zero(paged_attention, window) -> None:
    changed = _check(paged_attention, [30], [30], [[(5, 21)]], window)
    # Rows of the span but its last see later keys; the text rows stay causal.
    assert (changed[5:20] > 1e-3).all()
    assert (changed[:5] < 1e-5).all() and (changed[20:] < 1e-5).all()


@pytest.mark.parametrize("paged_attention", BACKENDS)
def test_spans_in_a_chunk_starting_mid_context_beside_decodes(paged_attention) -> None:
    # Request 1's chunk is positions [24, 60) of its context; two spans inside it, 8 apart.
    spans = [[], [(28, 44), (50, 58)], []]
    changed = _check(paged_attention, [1, 36, 1], [20, 60, 33], spans, window=12)
    rows = 1 + torch.arange(36)  # request 1's rows; position = 24 + row - 1
    positions = 24 + rows - 1
    in_span = ((positions >= 28) & (positions < 43)) | ((positions >= 50) & (positions < 57))
    assert (changed[rows[in_span]] > 1e-3).all() and (changed[rows[~in_span]] < 1e-5).all()
    assert changed[0] < 1e-5 and changed[-1] < 1e-5


def test_a_span_must_lie_inside_its_chunk() -> None:
    with pytest.raises(ValueError, match=r"span \[20, 36\) of request 0 is not inside"):
        paged_batch(
            [16], [40], num_heads=4, num_kv_heads=2, head_dim=32, bidirectional=[[(20, 36)]]
        )


def test_metadata_says_when_a_step_has_spans() -> None:
    _, _, with_spans = paged_batch([8], [8], num_heads=2, num_kv_heads=2, head_dim=8,
                                   bidirectional=[[(2, 6)]])  # fmt: skip
    _, _, without = paged_batch([8], [8], num_heads=2, num_kv_heads=2, head_dim=8)
    assert isinstance(with_spans, AttentionMetadata)
    assert with_spans.has_bidirectional and not without.has_bidirectional
