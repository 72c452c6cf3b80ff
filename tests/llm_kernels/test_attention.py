"""llm_kernels.attention against a naive per-request, per-token reference written here."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from llm_kernels import attention
from llm_kernels.attention import copy_blocks, paged_attention, reshape_and_cache, swap_blocks
from llm_kernels.attention_metadata import AttentionMetadata

CPU = torch.device("cpu")
TOLERANCE = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.5e-2,
}


@dataclass(frozen=True)
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor
    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    slot_mapping: np.ndarray
    block_size: int

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata.build(
            query_lens=self.query_lens,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            slot_mapping=self.slot_mapping,
            block_size=self.block_size,
            device=CPU,
        )


def make_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    table_padding: int = 0,
    seed: int = 0,
) -> Batch:
    """A random cache whose physical blocks are handed out in shuffled order, so no request's
    blocks are contiguous or sorted, and block 0 belongs to some request (padding reads it)."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    physical = rng.permutation(num_blocks)
    block_table = np.full(
        (len(seq_lens), max(blocks_per_seq, default=0) + 1), table_padding, dtype=np.int32
    )
    slot_mapping = []
    next_block = 0
    for b, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        block_table[b, : blocks_per_seq[b]] = physical[next_block : next_block + blocks_per_seq[b]]
        next_block += blocks_per_seq[b]
        for pos in range(seq_len - query_len, seq_len):
            slot_mapping.append(block_table[b, pos // block_size] * block_size + pos % block_size)
    kv_cache = torch.randn(
        2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator
    ).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(dtype)
    return Batch(
        query=query,
        kv_cache=kv_cache,
        query_lens=np.array(query_lens, dtype=np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        block_table=block_table,
        slot_mapping=np.array(slot_mapping, dtype=np.int64),
        block_size=block_size,
    )


def reference_attention(batch: Batch, scale: float) -> torch.Tensor:
    """Float64, one request and one query token at a time: contiguous K/V rebuilt from the
    block table, then a plain softmax over the keys at positions <= the token's own."""
    num_tokens, num_heads, _ = batch.query.shape
    num_kv_heads = batch.kv_cache.shape[3]
    kv_head_of = torch.arange(num_heads) // (num_heads // num_kv_heads)
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    row = 0
    for query_len, seq_len, table in zip(
        batch.query_lens, batch.seq_lens, batch.block_table, strict=True
    ):
        blocks = table[: math.ceil(seq_len / batch.block_size)].tolist()
        keys = torch.cat([batch.kv_cache[0, blk] for blk in blocks])[:seq_len].double()
        values = torch.cat([batch.kv_cache[1, blk] for blk in blocks])[:seq_len].double()
        for i in range(query_len):
            visible = seq_len - query_len + i + 1
            k = keys[:visible, kv_head_of]  # [visible, num_heads, head_dim]
            v = values[:visible, kv_head_of]
            q = batch.query[row].double()  # [num_heads, head_dim]
            probs = torch.softmax(torch.einsum("thd,hd->ht", k, q) * scale, dim=-1)
            out[row] = torch.einsum("ht,thd->hd", probs, v)
            row += 1
    assert row == num_tokens
    return out


def check_against_reference(batch: Batch) -> None:
    scale = batch.query.shape[-1] ** -0.5
    out = paged_attention(batch.query, batch.kv_cache, batch.metadata(), scale)
    assert out.shape == batch.query.shape
    assert out.dtype == batch.query.dtype
    expected = reference_attention(batch, scale)
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


# --- paged_attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("seq_len", [2, 15, 17, 31, 33, 100])
def test_decode_context_not_a_multiple_of_block_size(seq_len: int, block_size: int) -> None:
    check_against_reference(make_batch([1, 1], [seq_len, seq_len + 7], block_size=block_size))


def test_decode_with_one_token_context() -> None:
    check_against_reference(make_batch([1], [1]))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("query_len", "seq_len"), [(40, 100), (33, 65), (2, 50)])
def test_prefill_chunk_starting_mid_context(query_len: int, seq_len: int, block_size: int) -> None:
    """The first seq_len - query_len positions are already cached; the chunk spans blocks."""
    check_against_reference(make_batch([query_len], [seq_len], block_size=block_size))


@pytest.mark.parametrize("seq_len", [2, 16, 50])
def test_prefill_from_position_zero(seq_len: int) -> None:
    check_against_reference(make_batch([seq_len], [seq_len]))


def test_batch_interleaving_decode_and_prefill_requests() -> None:
    check_against_reference(
        make_batch([1, 37, 1, 1, 20, 1, 5], [9, 37, 130, 1, 75, 64, 5], block_size=16)
    )


def test_decode_requests_of_very_different_lengths() -> None:
    """Many decode contexts, from 1 to 700 tokens, beside a prefill."""
    rng = np.random.default_rng(1)
    seq_lens = [int(s) for s in rng.integers(1, 700, size=40)] + [1, 700, 30]
    query_lens = [1] * len(seq_lens)
    query_lens[-1] = 30
    check_against_reference(make_batch(query_lens, seq_lens))


def test_decode_grouping_bounds_padding_and_covers_every_request() -> None:
    rng = np.random.default_rng(2)
    seq_lens = rng.integers(1, 2000, size=64)
    metadata = make_batch([1] * 64, seq_lens.tolist(), num_heads=2, head_dim=8).metadata()
    rows = torch.cat([g.token_rows for g in metadata.decode_groups]).sort().values
    assert rows.tolist() == list(range(64))
    for group in metadata.decode_groups:
        blocks = np.ceil(seq_lens[group.token_rows.numpy()] / 16)
        assert group.max_blocks == blocks.max()
        assert group.max_blocks <= max(2 * blocks.min(), 8)


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"]
)
def test_grouped_query_attention(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    check_against_reference(
        make_batch(
            [1, 12, 1],
            [40, 30, 17],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
    )


def test_blocks_are_read_through_the_block_table_not_by_position() -> None:
    """Same logical context stored in reversed physical order gives the same output."""
    batch = make_batch([1, 6], [70, 40], seed=3)
    scale = 0.125
    reversed_ids = batch.kv_cache.shape[1] - 1 - np.arange(batch.kv_cache.shape[1])
    moved_cache = batch.kv_cache.flip(1)
    moved_table = reversed_ids[batch.block_table].astype(np.int32)
    moved = Batch(
        query=batch.query,
        kv_cache=moved_cache,
        query_lens=batch.query_lens,
        seq_lens=batch.seq_lens,
        block_table=moved_table,
        slot_mapping=batch.slot_mapping,
        block_size=batch.block_size,
    )
    torch.testing.assert_close(
        paged_attention(moved.query, moved.kv_cache, moved.metadata(), scale),
        paged_attention(batch.query, batch.kv_cache, batch.metadata(), scale),
        atol=0,
        rtol=0,
    )
    check_against_reference(moved)


def test_block_table_padding_past_a_request_blocks_is_ignored() -> None:
    """Entries after ceil(seq_len / block_size) may hold anything, even invalid ids."""
    check_against_reference(make_batch([1, 9], [20, 40], table_padding=-7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_each_dtype_matches_reference_within_its_tolerance(dtype: torch.dtype) -> None:
    check_against_reference(make_batch([1, 24, 1], [50, 60, 3], dtype=dtype))


@pytest.mark.parametrize("native_bf16", [False, True])
def test_bf16_matches_reference_attended_in_either_dtype(
    native_bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both bf16 paths, whatever this CPU has: SDPA in bf16 (native bf16 CPUs) and K/V
    converted to float32 (the rest), on decode groups of GQA and MQA mixed with prefill chunks."""
    monkeypatch.setattr(attention, "_native_cpu_bf16", lambda: native_bf16)
    for num_heads, num_kv_heads in ((12, 4), (8, 1), (4, 4)):
        batch = make_batch(
            [1, 17, 1, 1, 40], [70, 60, 3, 129, 40], dtype=torch.bfloat16,
            num_heads=num_heads, num_kv_heads=num_kv_heads, seed=num_heads,
        )  # fmt: skip
        assert attention.sdpa_dtype(batch.kv_cache.dtype, batch.kv_cache.device) == (
            torch.bfloat16 if native_bf16 else torch.float32
        )
        check_against_reference(batch)


def test_request_without_new_tokens_contributes_no_rows() -> None:
    check_against_reference(make_batch([1, 0, 4], [10, 30, 4]))


def test_fp32_matches_plain_softmax_tightly() -> None:
    """The engine's greedy output is compared token for token with HF in fp32."""
    batch = make_batch([1, 1, 64], [513, 3, 200], num_heads=12, num_kv_heads=4, seed=4)
    scale = 0.125
    out = paged_attention(batch.query, batch.kv_cache, batch.metadata(), scale)
    assert (out.double() - reference_attention(batch, scale)).abs().max() < 2e-6


def test_layers_sharing_one_metadata_get_independent_results() -> None:
    """Every layer of a step reuses the metadata (and its gather workspace)."""
    first = make_batch([1, 30, 1], [90, 45, 7], seed=6)
    second = dataclasses.replace(
        first, query=torch.randn_like(first.query), kv_cache=torch.randn_like(first.kv_cache)
    )
    layers = [first, second]
    metadata = first.metadata()
    scale = 0.125
    outputs = [paged_attention(b.query, b.kv_cache, metadata, scale) for b in layers]
    for batch, out in zip(layers, outputs, strict=True):
        torch.testing.assert_close(
            out.double(), reference_attention(batch, scale), atol=1e-5, rtol=0
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference(dtype: torch.dtype) -> None:
    batch = make_batch([1, 40, 1, 7], [70, 100, 1, 7], dtype=dtype)
    cuda = torch.device("cuda")
    metadata = AttentionMetadata.build(
        query_lens=batch.query_lens,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        slot_mapping=batch.slot_mapping,
        block_size=batch.block_size,
        device=cuda,
    )
    out = paged_attention(batch.query.to(cuda), batch.kv_cache.to(cuda), metadata, 0.125)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        out.cpu().double(), reference_attention(batch, 0.125), atol=tol, rtol=tol
    )


def test_query_may_be_a_strided_view_of_fused_qkv() -> None:
    batch = make_batch([1, 9, 1], [33, 20, 5], num_heads=8, num_kv_heads=2)
    qkv = torch.randn(batch.query.shape[0], 8 + 2 * 2, batch.query.shape[2])
    qkv[:, :8] = batch.query
    out = paged_attention(qkv[:, :8], batch.kv_cache, batch.metadata(), 0.125)
    assert out.is_contiguous()
    torch.testing.assert_close(out.double(), reference_attention(batch, 0.125), atol=1e-5, rtol=0)


def test_metadata_exposes_device_tensors() -> None:
    batch = make_batch([1, 5, 1], [10, 20, 3])
    metadata = batch.metadata()
    assert metadata.num_seqs == 3
    assert metadata.num_tokens == 7
    assert metadata.max_query_len == 5
    assert metadata.max_seq_len == 20
    assert metadata.query_start_loc.tolist() == [0, 1, 6, 7]
    assert metadata.query_start_loc.dtype == torch.int32
    assert metadata.seq_lens.tolist() == [10, 20, 3]
    assert metadata.block_table.dtype == torch.int32
    assert metadata.block_table.tolist() == batch.block_table.tolist()
    assert metadata.slot_mapping.dtype == torch.int64
    assert metadata.slot_mapping.tolist() == batch.slot_mapping.tolist()


def test_metadata_does_not_alias_caller_buffers() -> None:
    batch = make_batch([1, 3], [10, 20])
    metadata = batch.metadata()
    expected = paged_attention(batch.query, batch.kv_cache, metadata, 0.125)
    batch.block_table[:] = 0
    batch.slot_mapping[:] = 0
    torch.testing.assert_close(
        paged_attention(batch.query, batch.kv_cache, metadata, 0.125), expected, atol=0, rtol=0
    )


# --- reshape_and_cache -------------------------------------------------------------------------


def test_reshape_and_cache_writes_exactly_the_given_slots() -> None:
    block_size, num_kv_heads, head_dim = 4, 2, 8
    kv_cache = torch.randn(2, 6, block_size, num_kv_heads, head_dim)
    before = kv_cache.clone()
    slots = torch.tensor([5, 22, 0, 13, 23], dtype=torch.int64)
    key = torch.randn(5, num_kv_heads, head_dim)
    value = torch.randn(5, num_kv_heads, head_dim)

    reshape_and_cache(key, value, kv_cache, slots)

    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat[0, slots], key, atol=0, rtol=0)
    torch.testing.assert_close(flat[1, slots], value, atol=0, rtol=0)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    torch.testing.assert_close(
        flat[:, untouched], before.view_as(flat)[:, untouched], atol=0, rtol=0
    )


def test_reshape_and_cache_skips_negative_slots() -> None:
    kv_cache = torch.zeros(2, 3, 4, 1, 8)
    slots = torch.tensor([-1, 7, -5], dtype=torch.int64)
    key = torch.full((3, 1, 8), 1.0)
    value = torch.full((3, 1, 8), 2.0)

    reshape_and_cache(key, value, kv_cache, slots)

    flat = kv_cache.view(2, -1, 1, 8)
    written = (flat != 0).any(dim=-1).any(dim=-1)
    assert written[0].nonzero().flatten().tolist() == [7]
    assert written[1].nonzero().flatten().tolist() == [7]
    assert (flat[0, 7] == 1.0).all()
    assert (flat[1, 7] == 2.0).all()


def test_reshape_and_cache_then_attention_sees_the_new_tokens() -> None:
    batch = make_batch([1, 6], [30, 40], seed=5)
    num_tokens = len(batch.slot_mapping)
    key = torch.randn(num_tokens, *batch.kv_cache.shape[3:])
    value = torch.randn(num_tokens, *batch.kv_cache.shape[3:])
    metadata = batch.metadata()

    reshape_and_cache(key, value, batch.kv_cache, metadata.slot_mapping)

    flat = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[3:])
    torch.testing.assert_close(flat[0, metadata.slot_mapping], key, atol=0, rtol=0)
    check_against_reference(batch)


# --- copy_blocks / swap_blocks -----------------------------------------------------------------


def test_copy_blocks_copies_named_blocks_in_every_layer() -> None:
    layers = [torch.randn(2, 8, 4, 2, 8) for _ in range(3)]
    before = [layer.clone() for layer in layers]
    mapping = torch.tensor([[3, 7], [5, 1], [3, 0]], dtype=torch.int64)

    copy_blocks(layers, mapping)

    for layer, old in zip(layers, before, strict=True):
        expected = old.clone()
        expected[:, [7, 1, 0]] = old[:, [3, 5, 3]]
        torch.testing.assert_close(layer, expected, atol=0, rtol=0)


def swap_devices() -> list[tuple[str, str]]:
    pairs = [("cpu", "cpu")]
    if torch.cuda.is_available():
        pairs += [("cuda", "cpu"), ("cpu", "cuda")]
    return pairs


@pytest.mark.parametrize(("src_device", "dst_device"), swap_devices())
def test_swap_blocks_moves_named_blocks_between_caches(src_device: str, dst_device: str) -> None:
    src = torch.randn(2, 10, 4, 2, 8, device=src_device)
    dst = torch.randn(2, 6, 4, 2, 8, device=dst_device)
    before = dst.clone()
    mapping = torch.tensor([[9, 0], [2, 5], [4, 3]], dtype=torch.int64)

    swap_blocks(src, dst, mapping)

    expected = before.cpu()
    expected[:, [0, 5, 3]] = src.cpu()[:, [9, 2, 4]]
    torch.testing.assert_close(dst.cpu(), expected, atol=0, rtol=0)


# --- input checking ----------------------------------------------------------------------------


def test_attention_rejects_heads_not_a_multiple_of_kv_heads() -> None:
    batch = make_batch([1], [5], num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="query has 3 heads but kv_cache has 2 kv heads"):
        paged_attention(batch.query, batch.kv_cache, batch.metadata(), 0.1)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda q, kv: (q.half(), kv), "query has dtype"),
        (lambda q, kv: (q[..., :32], kv), "query has head_dim 32"),
        (lambda q, kv: (q[:2], kv), "query has 2 tokens"),
        (lambda q, kv: (q[0], kv), "query must have shape"),
        (lambda q, kv: (q, kv[0]), "kv_cache must have shape"),
        (lambda q, kv: (q, kv.transpose(3, 4)), "kv_cache"),
        (lambda q, kv: (q, kv[:, :, :8].contiguous()), "block_size"),
        (lambda q, kv: (q, kv[:, :2].contiguous()), "kv_cache has 2 blocks"),
    ],
    ids=[
        "dtype",
        "head_dim",
        "num_tokens",
        "rank",
        "cache_rank",
        "cache_shape",
        "block_size",
        "num_blocks",
    ],
)
def test_attention_rejects_mismatched_inputs(
    mutate: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]], match: str
) -> None:
    batch = make_batch([1, 2], [20, 30])
    query, kv_cache = mutate(batch.query, batch.kv_cache)
    with pytest.raises(ValueError, match=match):
        paged_attention(query, kv_cache, batch.metadata(), 0.1)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"slot_mapping": np.zeros(5, dtype=np.int64)}, "slot_mapping has 5 entries"),
        ({"seq_lens": np.array([1, 1], dtype=np.int32)}, "seq_lens must be >= query_lens"),
        ({"seq_lens": np.array([20], dtype=np.int32)}, "seq_lens has 1 entries"),
        ({"query_lens": np.array([1.0, 2.0])}, "query_lens must be an integer array"),
        ({"block_table": np.zeros((2, 1), dtype=np.int32)}, "block_table has 1 columns"),
        ({"block_table": np.zeros(4, dtype=np.int32)}, "block_table must be 2-D"),
        ({"block_size": 0}, "block_size must be a positive int"),
    ],
)
def test_metadata_build_rejects_inconsistent_inputs(
    override: dict[str, object], match: str
) -> None:
    batch = make_batch([1, 2], [20, 30])
    kwargs = {
        "query_lens": batch.query_lens,
        "seq_lens": batch.seq_lens,
        "block_table": batch.block_table,
        "slot_mapping": batch.slot_mapping,
        "block_size": batch.block_size,
        "device": CPU,
    } | override
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build(**kwargs)


def test_reshape_and_cache_rejects_bad_inputs() -> None:
    kv_cache = torch.zeros(2, 3, 4, 2, 8)
    key = torch.zeros(2, 2, 8)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        reshape_and_cache(key, key, kv_cache, slots.int())
    with pytest.raises(ValueError, match=r"slot_mapping must have shape \[2\]"):
        reshape_and_cache(key, key, kv_cache, slots[:1])
    with pytest.raises(ValueError, match=r"key must have shape \[num_tokens, 2, 8\]"):
        reshape_and_cache(torch.zeros(2, 1, 8), key, kv_cache, slots)
    with pytest.raises(ValueError, match="value has dtype"):
        reshape_and_cache(key, key.double(), kv_cache, slots)


def test_copy_and_swap_reject_bad_block_mappings() -> None:
    cache = torch.zeros(2, 4, 2, 1, 8)
    with pytest.raises(ValueError, match=r"block_mapping must be in \[0, 4\)"):
        copy_blocks([cache], torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match=r"block_mapping must have shape \[K, 2\]"):
        copy_blocks([cache], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="block_mapping must be int64"):
        swap_blocks(cache, cache.clone(), torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_mapping\[:, 1\] must be in \[0, 2\)"):
        swap_blocks(cache, torch.zeros(2, 2, 2, 1, 8), torch.tensor([[3, 2]]))
    with pytest.raises(ValueError, match="dst has shape"):
        swap_blocks(cache, torch.zeros(2, 4, 2, 2, 8), torch.tensor([[0, 1]]))
