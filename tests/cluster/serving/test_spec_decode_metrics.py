"""Speculative-decoding counters reach ``/metrics``: a real engine's stats snapshot (n-gram
speculation on a looping prompt) published through ``ModelMetrics``, the Ray metric classes
replaced by recorders that render Prometheus text (tests/cluster/serving/metric_recorders.py)."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.bench import throughput
from cluster.bench.workload import make_workload
from cluster.serving.metrics import ModelMetrics
from engine import SamplingParams
from engine.client.core_loop import EngineCoreLoop
from engine.core.llm_engine import LLMEngine
from tests.cluster.serving.metric_recorders import SAMPLES, recorded_model_metrics


@pytest.fixture
def model_metrics(monkeypatch: pytest.MonkeyPatch) -> ModelMetrics:
    return recorded_model_metrics(monkeypatch, "tiny")


def test_spec_decode_counters_in_metrics(model_metrics: ModelMetrics) -> None:
    engine = LLMEngine.from_engine_args(
        model="builtin:tiny-llama",
        device="cpu",
        num_kv_blocks=64,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    # The proposals come from the prompt's repeats; whatever the random model accepts, every
    # verification step is counted.
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 8, 9] * 4}, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))  # fmt: skip
    while engine.has_unfinished_requests():
        engine.step()
    loop = EngineCoreLoop(engine, on_step=lambda _: None, on_dead=lambda _: None)
    try:
        stats = loop.stats().result(timeout=30)
    finally:
        loop.shutdown()
    spec = engine.spec_decode_stats
    assert stats.spec_num_drafts == spec.num_drafts > 0
    assert stats.spec_num_draft_tokens == spec.num_draft_tokens
    model_metrics.publish(stats)
    tags = (("model", "tiny"), ("replica", "r1"))
    name = "llm_cluster_spec_decode_num_drafts_total"
    assert SAMPLES[(name, tags)] == spec.num_drafts
    name = "llm_cluster_spec_decode_num_draft_tokens_total"
    assert SAMPLES[(name, tags)] == spec.num_draft_tokens
    for pos, count in enumerate(spec.accepted_per_pos):
        key = ("llm_cluster_spec_decode_num_accepted_tokens_per_pos_total",
               (*tags[:1], ("position", str(pos)), tags[1]))  # fmt: skip
        assert SAMPLES.get(key, 0) == count


def test_bench_throughput_reports_acceptance(capsys: pytest.CaptureFixture[str]) -> None:
    from engine import LLM

    llm = LLM(
        "builtin:tiny-llama",
        device="cpu",
        num_kv_blocks=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    )  # fmt: skip
    wl = make_workload(8, (16, 32), (16, 32), 1024, 0)
    _, profile = throughput._timed_generate(llm, wl)
    spec = profile["spec_decode"]
    # Counted over the timed run only (the warm-up's were reset).
    assert spec["num_drafts"] > 0
    assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0
    assert len(spec["accepted_per_pos"]) <= 2
    throughput._print_table(
        {"conditions": _conditions(), "systems": {}, "ratios": {}, "roofline": {},
         "step_profile": profile}
    )  # fmt: skip
    assert "speculative decoding: " in capsys.readouterr().out


def _conditions() -> dict[str, Any]:
    return {
        "date": "d", "machine": "m", "device": "cpu", "dtype": "float32",
        "model": {"family": "llama", "parameters": 1e6},
        "workload": {"num_prompts": 8, "input_len": [16, 32], "output_len": [16, 32]},
    }  # fmt: skip
