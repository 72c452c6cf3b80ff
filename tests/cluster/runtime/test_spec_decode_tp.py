"""Speculative decoding (n-gram) with tensor parallelism: TP = 2 on Ray worker actors (gloo, CPU)
gives the greedy tokens of TP = 1 without speculation, with proposals accepted. The sampling
rank verifies; every rank computes the [last token + proposals] rows of the step.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.spec_decode.spec_decode_models import make_looping_model, ngram

# Starts Ray: the full suite, not the fast tier.
pytestmark = [pytest.mark.slow, pytest.mark.local_ray(num_cpus=4)]

ARGS = {"device": "cpu", "num_kv_blocks": 128, "max_model_len": 256, "max_num_batched_tokens": 16}
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
rng = random.Random(1)
PROMPTS = [[rng.randrange(3, 256) for _ in range(rng.randrange(4, 30))] for _ in range(6)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Loops under greedy decoding (HF's 0.02 init), so the n-gram proposals get accepted.
    return make_looping_model(tmp_path_factory.mktemp("spec_tp") / "m")


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_tp2_with_ngram_speculation_equals_tp1_without(model: Path) -> None:
    reference = LLM(str(model), distributed_executor_backend="uni", **ARGS)
    expect = greedy(reference)
    reference.llm_engine.shutdown()
    llm = LLM(str(model), tensor_parallel_size=2, speculative_config=ngram(3), **ARGS)
    try:
        assert type(llm.llm_engine.executor).__name__ == "RayExecutor"
        assert greedy(llm) == expect
        assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0
    finally:
        llm.llm_engine.shutdown()
