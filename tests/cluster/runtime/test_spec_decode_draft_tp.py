"""Speculative decoding with a draft model under tensor parallelism: TP = 2 on Ray worker actors
(gloo, CPU), the draft sharded like the target on the same ranks, gives the greedy tokens of
TP = 1 without speculation. The sampling rank's draft tokens reach the other rank through an
all-reduce each draft pass.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.spec_decode.spec_decode_models import (
    draft,
    generate,
    make_looping_model,
    make_small_draft,
)

# Starts Ray: the full suite, not the fast tier.
pytestmark = [pytest.mark.slow, pytest.mark.local_ray(num_cpus=4)]

ARGS = {"device": "cpu", "num_kv_blocks": 128, "max_model_len": 256, "max_num_batched_tokens": 16}
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
rng = random.Random(2)
PROMPTS = [[rng.randrange(3, 256) for _ in range(rng.randrange(4, 30))] for _ in range(6)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_looping_model(tmp_path_factory.mktemp("draft_tp") / "m")


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_small_draft(tmp_path_factory.mktemp("draft_tp") / "d", 2, seed=5,
                            max_position_embeddings=256)  # fmt: skip


def greedy(llm: LLM) -> list[list[int]]:
    return generate(llm, GREEDY, PROMPTS)


def test_tp2_with_draft_models_equals_tp1_without(model: Path, small_draft: Path) -> None:
    reference = LLM(str(model), distributed_executor_backend="uni", **ARGS)
    expect = greedy(reference)
    reference.llm_engine.shutdown()
    for path in (model, small_draft):
        llm = LLM(str(model), tensor_parallel_size=2, speculative_config=draft(path, 3), **ARGS)
        try:
            assert type(llm.llm_engine.executor).__name__ == "RayExecutor"
            assert greedy(llm) == expect
            stats = llm.llm_engine.spec_decode_stats
            assert stats.num_draft_tokens > 0
            if path == model:
                assert stats.num_accepted_tokens == stats.num_draft_tokens
        finally:
            llm.llm_engine.shutdown()
