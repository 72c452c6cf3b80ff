"""KV cache groups, driven without a model: a sliding-window group holds only its window, frees
what falls out of it, and lets more sequences fit in the same memory."""

from __future__ import annotations

import pytest

from engine.core.block_manager import BlockManager
from engine.core.kv_cache_groups import (
    FULL_ATTENTION,
    KVCacheGroupSpec,
    KVCacheLayout,
    kv_cache_group_specs,
    plan_group_blocks,
    request_block_capacity,
)
from engine.core.request import Request
from engine.sampling_params import SamplingParams

BS = 16
WINDOW = 128  # 1/8 of MAX_LEN, as Gemma 3's 1024 of 8k
MAX_LEN = 1024
SLIDING = KVCacheGroupSpec(WINDOW)
# Gemma 3's shape: five sliding layers per full one, all with the same K/V size.
GEMMA3_BYTES = [[1 * 2048, 5 * 2048]]


def gemma3_hf(num_layers: int = 12) -> dict:
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": num_layers,
        "sliding_window": WINDOW,
    }


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=MAX_LEN)


def grow(bm: BlockManager, req: Request, n: int) -> bool:
    """Allocate and compute n more tokens, as a scheduler step would; False if they do not fit."""
    if bm.allocate_slots(req, n) is None:
        return False
    req.num_computed_tokens += n
    bm.cache_blocks(req)
    return True


def hybrid(num_full: int, num_sliding: int, num_cpu: int = 0) -> BlockManager:
    layout = KVCacheLayout((FULL_ATTENTION, SLIDING), (num_full, num_sliding), (num_cpu, num_cpu))
    return BlockManager(layout, BS)


def test_gemma3_layers_form_a_full_and_a_sliding_group() -> None:
    assert kv_cache_group_specs(gemma3_hf(), MAX_LEN) == (FULL_ATTENTION, SLIDING)
    # A window that covers max_model_len hides nothing: one group, as before groups.
    assert kv_cache_group_specs(gemma3_hf(), WINDOW) == (FULL_ATTENTION,)
    mistral = {"architectures": ["MistralForCausalLM"], "num_hidden_layers": 2}
    assert kv_cache_group_specs({**mistral, "sliding_window": 64}, MAX_LEN) == (
        KVCacheGroupSpec(64),
    )
    assert kv_cache_group_specs({**mistral, "sliding_window": None}, MAX_LEN) == (FULL_ATTENTION,)


def test_sliding_group_holds_only_its_window_at_full_length() -> None:
    bm = hybrid(200, 40)
    req = make_request("a", list(range(MAX_LEN)))
    assert grow(bm, req, 256)  # a prefill chunk holds the window plus the chunk
    full, sliding = bm.num_held_blocks("a")
    assert (full, sliding) == (16, 16)
    most = 0
    while req.num_computed_tokens < MAX_LEN:
        assert grow(bm, req, 1)
        full, sliding = bm.num_held_blocks("a")
        assert full == -(-req.num_computed_tokens // BS)
        most = max(most, sliding)
    # A decode step's window (128 keys, the new one included) spans 8 or 9 blocks.
    assert most == -(-WINDOW // BS) + 1
    full, sliding = bm.num_held_blocks("a")
    assert full == MAX_LEN // BS and sliding <= most
    # Every table keeps one entry per logical block: the freed ones are the null block.
    sliding_ids = bm.get_block_ids("a")[MAX_LEN // BS :]
    null = bm.layout.offsets[1]
    assert sliding_ids == [null] * (MAX_LEN // BS - sliding) + sliding_ids[-sliding:]
    assert null not in sliding_ids[-sliding:]
    bm.check_integrity()
    bm.free(req)
    assert bm.stats().used == 0
    bm.check_integrity()


def test_blocks_that_fall_out_of_the_window_return_to_the_pool() -> None:
    bm = hybrid(200, 40)
    req = make_request("a", list(range(MAX_LEN)))
    assert grow(bm, req, WINDOW)
    free_before = len(bm.groups[1].free_queue)
    assert grow(bm, req, 4 * BS)  # the next step first frees what its queries cannot see
    assert grow(bm, req, 1)
    # 4 blocks left the window and 4 (+1 for the new token) were taken.
    assert len(bm.groups[1].free_queue) == free_before - 4 - 1 + 4
    bm.check_integrity()


def test_more_max_model_len_sequences_fit_in_the_same_memory() -> None:
    num_blocks = 4 * MAX_LEN // BS  # all-layer blocks: 4 sequences of max_model_len
    layout = plan_group_blocks(
        (FULL_ATTENTION, SLIDING),
        num_blocks,
        0,
        GEMMA3_BYTES,
        block_size=BS,
        max_model_len=MAX_LEN,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        decode_tokens=1,
        batches_in_flight=1,
    )
    # The sliding pool: 16 decoding sequences of 9 blocks, one 256-token chunk, the null block.
    assert layout.num_blocks[1] == 16 * 9 + 16 + 1
    # What the sliding layers no longer need goes to the full-attention layer (5x its size).
    assert layout.num_blocks[0] == num_blocks + 5 * (num_blocks - layout.num_blocks[1])
    memory = sum(n * b for n, b in zip(layout.num_blocks, GEMMA3_BYTES[0]))
    assert memory <= num_blocks * sum(GEMMA3_BYTES[0])

    def sequences_that_fit(bm: BlockManager) -> int:
        fitted = 0
        while True:
            req = make_request(f"r{fitted}", list(range(MAX_LEN)))
            while req.num_computed_tokens < MAX_LEN:
                step = 256 if req.num_computed_tokens == 0 else 1
                if not grow(bm, req, step):
                    return fitted
            fitted += 1

    before = sequences_that_fit(BlockManager(num_blocks, BS))
    after = sequences_that_fit(BlockManager(layout, BS))
    assert before == 4
    assert after == layout.num_blocks[0] // (MAX_LEN // BS) == 11


def test_model_with_one_group_keeps_every_block_id() -> None:
    one = BlockManager(KVCacheLayout.single(10), BS)
    legacy = BlockManager(10, BS)
    for bm in (one, legacy):
        grow(bm, make_request("a", list(range(40))), 40)
    assert one.get_block_ids("a") == legacy.get_block_ids("a") == [0, 1, 2]


def test_all_sliding_model_is_one_sliding_group_that_frees() -> None:
    bm = BlockManager(KVCacheLayout((SLIDING,), (12,), (0,)), BS)
    req = make_request("a", list(range(MAX_LEN)))
    assert grow(bm, req, 64)
    while req.num_computed_tokens < MAX_LEN:
        assert grow(bm, req, 1), "11 usable blocks hold a 128-token window"
    assert bm.num_held_blocks("a")[0] <= 9
    assert request_block_capacity(bm.layout, BS, MAX_LEN) == MAX_LEN // BS


def test_sliding_prefix_hit_needs_only_the_window_before_the_hit_point() -> None:
    bm = hybrid(200, 12)  # a sliding pool so small that a's old blocks are reused as it grows
    prompt = list(range(MAX_LEN))
    a = make_request("a", prompt)
    assert grow(bm, a, 64)
    while a.num_computed_tokens < MAX_LEN:
        assert grow(bm, a, 1)
    bm.free(a)
    # Same prompt: the last 8 blocks before the hit point are still cached in the sliding pool.
    b = make_request("b", prompt)
    hits, num = bm.get_computed_blocks(b)
    hit_blocks = (MAX_LEN - 1) // BS
    assert num == hit_blocks * BS
    sliding_hits = hits[hit_blocks:]
    null = bm.groups[1].null_block
    assert sliding_hits[: hit_blocks - 8] == [null] * (hit_blocks - 8)
    assert null not in sliding_hits[hit_blocks - 8 :]
    assert bm.allocate_slots(b, MAX_LEN - num, hits) is not None
    bm.check_integrity()
    bm.free(b)
    # Sharing only a's first half: the full group has it all, the sliding pool long evicted
    # the window before that point, and the request's hit is the smaller of the two: none.
    c = make_request("c", prompt[: MAX_LEN // 2] + [7] * 64)
    assert bm.groups[0].longest_hit(bm.block_hashes(c, 35), 35) == MAX_LEN // 2 // BS
    assert bm.get_computed_blocks(c) == ([], 0)


def test_swap_round_trip_keeps_null_entries() -> None:
    bm = hybrid(200, 40, num_cpu=64)
    req = make_request("a", list(range(MAX_LEN)))
    assert grow(bm, req, 512)
    assert grow(bm, req, 1)
    table = bm.get_block_ids("a")
    held = bm.num_held_blocks("a")
    assert bm.can_swap_out(req)
    out = bm.swap_out(req)
    assert len(out) == sum(held)
    assert bm.stats().used == 0
    assert bm.can_swap_in(req, 1)
    back = bm.swap_in(req)
    assert [c for c, _ in back] == [c for _, c in out]
    new_table = bm.get_block_ids("a")
    null = bm.layout.offsets[1]
    assert [i == null for i in new_table] == [i == null for i in table]
    assert bm.num_held_blocks("a") == held
    bm.check_integrity()


def test_fork_shares_only_held_sliding_blocks() -> None:
    bm = hybrid(200, 40)
    parent = make_request("p", list(range(300)))
    assert grow(bm, parent, 300)
    assert grow(bm, parent, 0)  # the next schedule frees what fell out of the window
    child = make_request("c", list(range(300)))
    bm.fork(parent, child, 299)
    assert bm.get_block_ids("c") == bm.get_block_ids("p")
    bm.check_integrity()
    bm.free(parent)
    bm.free(child)
    assert bm.stats().used == 0


def test_usage_is_the_fullest_groups_share() -> None:
    bm = hybrid(101, 11)
    assert grow(bm, make_request("a", list(range(160))), 160)
    stats = bm.stats()
    assert stats.group_usage == (10 / 101, 10 / 10)
    assert stats.usage == 1.0


def test_a_sliding_group_needs_room_for_its_null_block() -> None:
    with pytest.raises(ValueError, match="null block"):
        hybrid(10, 1)
