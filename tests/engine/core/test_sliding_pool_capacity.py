"""How much one request may hold when a sliding-window group's pool is small (a fixed small
``num_kv_blocks``): a step needs every block it writes or reads at once, so a request that
could never get them is refused at once instead of waiting forever."""

from __future__ import annotations

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.core.kv_cache_groups import (
    FULL_ATTENTION,
    KVCacheGroupSpec,
    KVCacheLayout,
    request_block_capacity,
)


def test_small_sliding_pool_caps_what_one_request_may_hold() -> None:
    """A sliding pool (less its null block) smaller than one step's window holds a request
    only if all its blocks fit: a 3-block pool has 2 usable blocks, not a window's worth."""
    hybrid = KVCacheLayout.uniform([FULL_ATTENTION, KVCacheGroupSpec(40)], 3, 0)
    assert request_block_capacity(hybrid, 16, 256, step_tokens=64) == 2
    sliding_only = KVCacheLayout.uniform([KVCacheGroupSpec(16)], 4, 0)
    assert request_block_capacity(sliding_only, 16, 256, step_tokens=64) == 3
    # A pool that holds a whole step's window serves any length.
    roomy = KVCacheLayout.uniform([FULL_ATTENTION, KVCacheGroupSpec(40)], 64, 0)
    assert request_block_capacity(roomy, 16, 256, step_tokens=64) == 64
    roomy_sliding = KVCacheLayout.uniform([KVCacheGroupSpec(16)], 8, 0)
    assert request_block_capacity(roomy_sliding, 16, 256, step_tokens=64) == 16


def test_request_too_big_for_a_small_sliding_pool_is_refused_not_stuck() -> None:
    """Gemma 3 (window 40) with num_kv_blocks=3: a 40-token prompt + 8 needs 3 blocks, what the
    full pool holds, but the sliding pool has 2 usable: it used to be accepted and then wait
    forever (never admitted). Now it is refused; a request that fits runs to the end."""
    llm = LLM(
        "builtin:tiny-gemma3",
        dtype="float32",
        max_model_len=256,
        block_size=16,
        num_kv_blocks=3,
        max_num_batched_tokens=64,
    )
    engine = llm.llm_engine
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(
            "big", {"prompt_token_ids": list(range(5, 45))}, SamplingParams(max_tokens=8)
        )
    assert err.value.param == "max_tokens"
    engine.add_request(
        "fits", {"prompt_token_ids": list(range(5, 25))}, SamplingParams(max_tokens=8)
    )
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    stats = engine.get_kv_cache_stats()
    assert stats.used == 0
