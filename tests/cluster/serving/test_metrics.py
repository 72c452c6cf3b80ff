"""``ModelMetrics`` without Ray: each stats snapshot advances the MoE expert-load counters (and
the KV store's lookups and hits) by what came since the last one and sets each layer's
imbalance gauge; a dense model's
snapshot adds no expert series. The Ray metric classes are replaced by recorders that check
tags the way Ray does (exactly the declared keys) and render the samples as Prometheus text,
the lines ``GET /metrics`` shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.serving.metrics import ModelMetrics, RequestTimer, expert_load_imbalance
from engine.client.async_llm_engine import EngineStats
from engine.client.core_messages import CoreLoad
from engine.kv_transfer.store import BlockStore
from tests.cluster.serving.metric_recorders import prometheus_text, recorded_model_metrics


@pytest.fixture
def model_metrics(monkeypatch: pytest.MonkeyPatch) -> ModelMetrics:
    return recorded_model_metrics(monkeypatch, "moe")


def _stats(expert_tokens: dict[int, list[int]]) -> EngineStats:
    return EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, moe_expert_tokens=expert_tokens)


def test_expert_counters_advance_by_each_snapshots_new_tokens(model_metrics: ModelMetrics) -> None:
    model_metrics.publish(_stats({0: [3, 1, 0, 0], 2: [1, 1, 1, 1]}))
    model_metrics.publish(_stats({0: [7, 1, 0, 0], 2: [2, 2, 2, 2]}))

    text = prometheus_text()

    tokens = "llm_cluster_moe_expert_tokens_total"
    assert f'{tokens}{{expert="0",layer="0",model="moe",replica="r1"}} 7\n' in text
    assert f'{tokens}{{expert="1",layer="0",model="moe",replica="r1"}} 1\n' in text
    assert f'{tokens}{{expert="3",layer="2",model="moe",replica="r1"}} 2\n' in text
    # An expert that never received a token has no sample yet (Prometheus reads it as absent).
    assert 'expert="2",layer="0"' not in text
    imbalance = "llm_cluster_moe_expert_load_imbalance"
    assert f'{imbalance}{{layer="0",model="moe",replica="r1"}} 3.5\n' in text
    assert f'{imbalance}{{layer="2",model="moe",replica="r1"}} 1\n' in text


def test_a_dense_model_publishes_no_expert_series(model_metrics: ModelMetrics) -> None:
    model_metrics.publish(_stats({}))
    assert "moe_" not in prometheus_text()


def test_imbalance_is_max_over_mean() -> None:
    assert expert_load_imbalance([5, 5, 5, 5]) == 1.0
    assert expert_load_imbalance([8, 0, 0, 0]) == 4.0
    assert expert_load_imbalance([0, 0]) is None


def test_a_data_parallel_replica_publishes_each_cores_load(model_metrics: ModelMetrics) -> None:
    cores = [CoreLoad(3, 0, 0.25), CoreLoad(1, 2, 0.5)]
    model_metrics.publish(EngineStats(4, 2, 0, 0, 0.375, 0, 0, 0, 0, 0, 0, cores=cores))
    text = prometheus_text()
    tags = 'model="moe",replica="r1"'
    assert f'llm_cluster_core_requests_running{{core="0",{tags}}} 3\n' in text
    assert f'llm_cluster_core_requests_waiting{{core="1",{tags}}} 2\n' in text
    assert f'llm_cluster_core_kv_cache_usage_perc{{core="1",{tags}}} 0.5\n' in text
    assert f"llm_cluster_requests_running{{{tags}}} 4\n" in text  # the replica's, all cores


def test_kv_cache_usage_perc_is_a_fraction_like_vllms(model_metrics: ModelMetrics) -> None:
    # vLLM's metric of the same name: "1 means 100 percent usage" (Grafana's percentunit).
    model_metrics.publish(EngineStats(0, 0, 0, 0, 0.375, 0, 0, 0, 0, 0, 0))
    text = prometheus_text()
    assert 'llm_cluster_kv_cache_usage_perc{model="moe",replica="r1"} 0.375\n' in text


def test_a_single_core_replica_publishes_no_core_series(model_metrics: ModelMetrics) -> None:
    model_metrics.publish(_stats({}))
    assert "llm_cluster_core_" not in prometheus_text()


def test_the_kv_stores_lookups_and_hits_advance_their_counters(model_metrics: ModelMetrics) -> None:
    def stats(queries: int, hits: int) -> EngineStats:
        return EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0,
                           external_prefix_cache_queries=queries,
                           external_prefix_cache_hits=hits)  # fmt: skip

    model_metrics.publish(stats(64, 32))
    model_metrics.publish(stats(160, 96))
    text = prometheus_text()
    tags = 'model="moe",replica="r1"'
    assert f"llm_cluster_external_prefix_cache_queries_total{{{tags}}} 160\n" in text
    assert f"llm_cluster_external_prefix_cache_hits_total{{{tags}}} 96\n" in text


def test_the_nodes_kv_store_size_files_evictions_and_bound_are_gauges(
    model_metrics: ModelMetrics, tmp_path: Path
) -> None:
    store = BlockStore(str(tmp_path), "ns", shards=[0], max_bytes=1 << 20)
    for i in range(14):  # 1.4 MiB into a 1 MiB bound: the writers evict
        store.write(i.to_bytes(32, "big"), 0, bytes(100 * 1024))
    used, files, evicted = store.usage()
    assert evicted > 0 and files == 14 - evicted and used == files * 100 * 1024
    model_metrics.publish_kv_store(used, files, evicted, store.max_bytes)
    text = prometheus_text()
    tags = 'model="moe",replica="r1"'
    assert f"llm_cluster_kv_store_bytes{{{tags}}} {used}\n" in text
    assert f"llm_cluster_kv_store_files{{{tags}}} {files}\n" in text
    assert f"llm_cluster_kv_store_evicted_files{{{tags}}} {evicted}\n" in text
    (line,) = [x for x in text.splitlines() if x.startswith("llm_cluster_kv_store_capacity")]
    assert line.startswith(f"llm_cluster_kv_store_capacity_bytes{{{tags}}} ")
    assert abs(float(line.split()[-1]) - (1 << 20)) < 100  # (printed to 6 digits)


def test_latency_histograms_take_vllms_bucket_sets(model_metrics: ModelMetrics) -> None:
    # vLLM 0.32's vllm/v1/metrics/buckets.py: (first, last, how many) of each set.
    def shape(histogram: Any) -> tuple[float, float, int]:
        bounds = histogram.boundaries
        assert bounds == sorted(bounds)
        return bounds[0], bounds[-1], len(bounds)

    assert shape(model_metrics.ttft) == (0.001, 2560.0, 22)
    assert shape(model_metrics.itl) == (0.01, 80.0, 19)
    assert shape(model_metrics.e2e) == (0.3, 7680.0, 21)  # a request of 2 h is still in a bucket


class _Histogram:
    def __init__(self) -> None:
        self.samples: list[float] = []

    def observe(self, value: float, tags: Any) -> None:
        self.samples.append(round(value, 6))


class _Latencies:
    """A model's three latency histograms, recording what they observe."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}
        self.ttft, self.itl, self.e2e = _Histogram(), _Histogram(), _Histogram()


@pytest.mark.parametrize(
    ("sequences", "steps", "itl"),
    [
        (1, [(1.0, 1), (1.05, 1), (1.15, 1)], [0.05, 0.1]),
        (1, [(1.0, 1), (1.2, 4)], [0.2]),  # speculative decoding: 4 tokens, one step's gap
        (3, [(1.0, 3), (1.1, 3), (1.3, 2)], [0.1] * 3 + [0.2] * 2),  # one per sequence (vLLM)
    ],
)
def test_inter_token_latency_is_one_sample_per_sequence_per_step(
    sequences: int, steps: list[tuple[float, int]], itl: list[float]
) -> None:
    """As vLLM records it (vllm/v1/metrics/stats.py): a step's whole gap once per sequence
    that advanced; the tokens of a step did not share the gap (it read 4x low at 4 tokens)."""
    latencies = _Latencies()
    timer = RequestTimer(latencies, start=0.5, sequences=sequences)  # type: ignore[arg-type]
    for at, made in steps:
        timer.on_tokens(at, made)
    timer.finish(1.5)
    assert latencies.ttft.samples == [0.5]
    assert latencies.itl.samples == itl
    assert latencies.e2e.samples == [1.0]
