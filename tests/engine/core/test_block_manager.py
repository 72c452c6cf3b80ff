"""Block manager, driven without a model."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.block_manager import BlockManager
from engine.core.block_pool import hash_block_tokens
from engine.core.request import Request
from engine.multimodal.inputs import image_feature
from engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=8, cache_salt=salt)


def compute(bm: BlockManager, req: Request, n: int) -> None:
    """Allocate and mark n more tokens computed, as a scheduler step would."""
    if bm.allocate_slots(req, n) is None:
        raise RuntimeError("allocation failed")
    req.num_computed_tokens += n
    bm.cache_blocks(req)


def test_allocate_grows_block_table_to_cover_tokens() -> None:
    bm = BlockManager(10, BS)
    req = make_request("a", list(range(9)))
    blocks = bm.allocate_slots(req, 9)
    assert blocks is not None and len(blocks) == 3
    assert bm.num_free_blocks == 7
    bm.check_integrity()


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(2, BS)
    req = make_request("a", list(range(9)))
    assert bm.allocate_slots(req, 9) is None
    assert bm.num_free_blocks == 2
    assert bm.get_block_ids("a") == []
    bm.check_integrity()


def test_free_returns_every_block() -> None:
    bm = BlockManager(10, BS)
    req = make_request("a", list(range(9)))
    compute(bm, req, 9)
    bm.free(req)
    assert bm.num_free_blocks == 10
    bm.check_integrity()


def test_prefix_cache_hit_shares_full_blocks_and_leaves_one_token() -> None:
    bm = BlockManager(10, BS)
    a = make_request("a", list(range(8)))
    compute(bm, a, 8)
    b = make_request("b", list(range(8)))
    hits, num = bm.get_computed_blocks(b)
    # Both blocks match, but the last token must be recomputed to get logits: one block hit.
    assert num == 4 and [h.block_id for h in hits] == bm.get_block_ids("a")[:1]
    b.num_computed_tokens = num
    assert bm.allocate_slots(b, 4, hits) is not None
    assert bm.blocks[hits[0].block_id].ref_cnt == 2
    bm.check_integrity()


def test_cached_free_block_is_reused_after_owner_finished() -> None:
    bm = BlockManager(10, BS)
    a = make_request("a", list(range(9)))
    compute(bm, a, 9)
    bm.free(a)
    assert bm.stats().cached == 2  # two full blocks stay cached, the partial one does not
    b = make_request("b", [*range(8), 99, 100])
    hits, num = bm.get_computed_blocks(b)
    assert num == 8 and len(hits) == 2
    b.num_computed_tokens = num
    bm.allocate_slots(b, 2, hits)
    assert bm.stats().cached == 0
    bm.check_integrity()


def test_cached_blocks_are_evicted_only_under_pressure_lru_first() -> None:
    bm = BlockManager(4, BS)
    a = make_request("a", list(range(8)))
    compute(bm, a, 8)
    bm.free(a)
    # 2 uncached free blocks are used before any cached one.
    c = make_request("c", [50] * 8)
    assert bm.allocate_slots(c, 8) is not None
    assert bm.stats().cached == 2
    # Needing one more block evicts a cached one: a's tail block goes first (freed in reverse).
    d = make_request("d", [60] * 4)
    assert bm.allocate_slots(d, 4) is not None
    hits, _ = bm.get_computed_blocks(make_request("e", list(range(8)) + [1]))
    assert len(hits) == 1  # a's first block survived
    bm.check_integrity()


def test_different_cache_salt_never_shares_blocks() -> None:
    bm = BlockManager(10, BS)
    a = make_request("a", list(range(9)), salt="tenant-1")
    compute(bm, a, 9)
    b = make_request("b", list(range(9)), salt="tenant-2")
    assert bm.get_computed_blocks(b) == ([], 0)
    c = make_request("c", list(range(9)), salt="tenant-1")
    assert bm.get_computed_blocks(c)[1] == 8


def _with_image(rid: str, pixels: float, num_tokens: int = 9) -> Request:
    """Tokens 0..2 text, 3..6 one image's placeholders (id 9), 7..8 text (the first
    ``num_tokens`` of them)."""
    feature = image_feature(np.full((3, 2, 2), pixels, np.float32), offset=3, length=4)
    tokens = [0, 1, 2, 9, 9, 9, 9, 7, 8][:num_tokens]
    return Request(rid, tokens, SamplingParams(), max_tokens=8, mm_features=[feature])


def test_different_images_behind_the_same_placeholders_never_share_blocks() -> None:
    bm = BlockManager(10, BS)
    a = _with_image("a", 0.5)
    compute(bm, a, 9)
    # Block 0 (tokens 0..3) and block 1 (4..7) both hold the image's placeholders.
    assert bm.get_computed_blocks(_with_image("b", 0.25)) == ([], 0)
    assert bm.get_computed_blocks(_with_image("c", 0.5))[1] == 8


def test_whole_images_back_a_hit_ending_inside_an_image_off_before_it() -> None:
    # The hit of 8 tokens ends at the image's end (7): inside it only with a shorter prompt.
    bm = BlockManager(10, BS)
    compute(bm, _with_image("a", 0.5), 9)
    assert bm.get_computed_blocks(_with_image("c", 0.5), whole_images=True)[1] == 8
    # A prompt of 7 tokens can reuse one block (tokens 0..3), which ends inside the image
    # (3..6): without splitting, the hit backs off to before the image (block 0 holds it).
    short = _with_image("d", 0.5, num_tokens=7)
    assert bm.get_computed_blocks(short)[1] == 4
    assert bm.get_computed_blocks(short, whole_images=True) == ([], 0)


def test_cached_prefix_tokens_counts_what_a_request_would_reuse_and_changes_nothing() -> None:
    bm = BlockManager(10, BS)
    a = make_request("a", list(range(9)), salt="tenant-1")
    compute(bm, a, 9)
    before = (bm.stats(), bm.prefix_queries, bm.prefix_hits)
    # As get_computed_blocks would: whole blocks, the last token always left to compute.
    assert bm.cached_prefix_tokens(list(range(9)), "tenant-1") == 8
    assert bm.cached_prefix_tokens(list(range(8)), "tenant-1") == 4
    assert bm.cached_prefix_tokens([*range(4), 99, 5, 6, 7, 8], "tenant-1") == 4
    assert bm.cached_prefix_tokens(list(range(9)), "tenant-2") == 0
    assert bm.cached_prefix_tokens(list(range(9)), "tenant-1", lora="1:x:/a") == 0
    assert bm.cached_prefix_tokens([], None) == 0
    assert (bm.stats(), bm.prefix_queries, bm.prefix_hits) == before


def test_block_hash_chains_parent() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3, 4], None)
    assert hash_block_tokens(h1, [5, 6, 7, 8], None) != hash_block_tokens(None, [5, 6, 7, 8], None)
    assert len(h1) == 32


def test_swap_out_and_in_round_trip() -> None:
    bm = BlockManager(6, BS, num_cpu_blocks=4)
    a = make_request("a", list(range(9)))
    compute(bm, a, 9)
    gpu_ids = bm.get_block_ids("a")
    out = bm.swap_out(a)
    assert [g for g, _ in out] == gpu_ids
    assert bm.num_free_blocks == 6 and len(bm.free_cpu_blocks) == 1
    bm.check_integrity()
    back = bm.swap_in(a)
    assert [c for c, _ in back] == [c for _, c in out]
    assert bm.get_block_ids("a") == [g for _, g in back]
    assert len(bm.free_cpu_blocks) == 4
    bm.check_integrity()


def test_can_swap_out_respects_cpu_space() -> None:
    bm = BlockManager(6, BS, num_cpu_blocks=2)
    a = make_request("a", list(range(9)))
    compute(bm, a, 9)
    assert not bm.can_swap_out(a)


def test_integrity_check_detects_corruption() -> None:
    bm = BlockManager(4, BS)
    a = make_request("a", list(range(4)))
    compute(bm, a, 4)
    bm.blocks[bm.get_block_ids("a")[0]].ref_cnt = 5
    with pytest.raises(RuntimeError, match="ref_cnt"):
        bm.check_integrity()
