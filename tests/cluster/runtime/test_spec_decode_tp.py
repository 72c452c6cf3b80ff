"""Speculative decoding with tensor parallelism: TP = 2 on Ray worker actors (gloo, CPU) gives
the greedy tokens of TP = 1 without speculation, with proposals accepted.
- n-gram: the sampling rank verifies; every rank computes the [last token + proposals] rows of
  the step.
- a draft model, sharded like the target on the same ranks: the sampling rank's draft tokens
  reach the other rank through an all-reduce each draft pass.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from tests.engine.spec_decode.spec_decode_models import (
    draft,
    generate,
    make_looping_model,
    make_small_draft,
    ngram,
)

# Starts Ray: the full suite, not the fast tier.
pytestmark = [pytest.mark.slow, pytest.mark.local_ray(num_cpus=4)]

ARGS = {"device": "cpu", "num_kv_blocks": 128, "max_model_len": 256, "max_num_batched_tokens": 16}
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
rng = random.Random(1)
PROMPTS = [[rng.randrange(3, 256) for _ in range(rng.randrange(4, 30))] for _ in range(6)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Loops under greedy decoding (HF's 0.02 init), so the proposals get accepted.
    return make_looping_model(tmp_path_factory.mktemp("spec_tp") / "m")


@pytest.fixture(scope="module")
def expect(model: Path) -> list[list[int]]:
    """TP = 1's greedy tokens without speculation."""
    reference = LLM(str(model), distributed_executor_backend="uni", **ARGS)
    try:
        return generate(reference, GREEDY, PROMPTS)
    finally:
        reference.llm_engine.shutdown()


def _tp2(model: Path, speculative_config: dict[str, Any]) -> tuple[list[list[int]], Any]:
    """TP = 2's greedy tokens with ``speculative_config``, and its speculation stats."""
    llm = LLM(str(model), tensor_parallel_size=2, speculative_config=speculative_config, **ARGS)
    try:
        assert type(llm.llm_engine.executor).__name__ == "RayExecutor"
        return generate(llm, GREEDY, PROMPTS), llm.llm_engine.spec_decode_stats
    finally:
        llm.llm_engine.shutdown()


def test_tp2_with_ngram_speculation_equals_tp1_without(
    model: Path, expect: list[list[int]]
) -> None:
    tokens, stats = _tp2(model, ngram(3))
    assert tokens == expect
    assert stats.num_accepted_tokens > 0


def test_tp2_with_draft_models_equals_tp1_without(
    model: Path, expect: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    small = make_small_draft(tmp_path_factory.mktemp("spec_tp") / "d", 2, seed=5,
                             max_position_embeddings=256)  # fmt: skip
    for path in (model, small):
        tokens, stats = _tp2(model, draft(path, 3))
        assert tokens == expect
        assert stats.num_draft_tokens > 0
        if path == model:  # the target as its own draft: every proposal is accepted
            assert stats.num_accepted_tokens == stats.num_draft_tokens
