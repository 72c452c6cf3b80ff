"""``ModelMetrics`` without Ray: each stats snapshot advances the MoE expert-load counters by
what was routed since the last one and sets each layer's imbalance gauge; a dense model's
snapshot adds no expert series. The Ray metric classes are replaced by recorders that check
tags the way Ray does (exactly the declared keys) and render the samples as Prometheus text,
the lines ``GET /metrics`` shows."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.serving import metrics
from cluster.serving.metrics import ModelMetrics, expert_load_imbalance
from engine.async_llm_engine import EngineStats

SAMPLES: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}


class _Recorded:
    def __init__(self, name: str, description: str = "", *args: Any, **kwargs: Any) -> None:
        self.name = name
        self.tag_keys = tuple(kwargs.get("tag_keys", ()))

    def _key(self, tags: dict[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
        if set(tags) != set(self.tag_keys):
            raise ValueError(f"{self.name}: tags {sorted(tags)} != {sorted(self.tag_keys)}")
        return self.name, tuple(sorted(tags.items()))

    def inc(self, value: float, tags: dict[str, str]) -> None:
        if value <= 0:
            raise ValueError(f"{self.name}: counters only go up, got {value}")
        key = self._key(tags)
        SAMPLES[key] = SAMPLES.get(key, 0) + value

    def set(self, value: float, tags: dict[str, str]) -> None:
        SAMPLES[self._key(tags)] = value

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self._key(tags)


def _prometheus_text() -> str:
    lines = []
    for (name, tags), value in sorted(SAMPLES.items()):
        labels = ",".join(f'{k}="{v}"' for k, v in tags)
        lines.append(f"{name}{{{labels}}} {value:g}")
    return "\n".join(lines) + "\n"


@pytest.fixture
def model_metrics(monkeypatch: pytest.MonkeyPatch) -> ModelMetrics:
    SAMPLES.clear()
    for cls in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, cls, _Recorded)
    return ModelMetrics("moe", "r1")


def _stats(expert_tokens: dict[int, list[int]]) -> EngineStats:
    return EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, moe_expert_tokens=expert_tokens)


def test_expert_counters_advance_by_each_snapshots_new_tokens(model_metrics: ModelMetrics) -> None:
    model_metrics.publish(_stats({0: [3, 1, 0, 0], 2: [1, 1, 1, 1]}))
    model_metrics.publish(_stats({0: [7, 1, 0, 0], 2: [2, 2, 2, 2]}))

    text = _prometheus_text()

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
    assert "moe_" not in _prometheus_text()


def test_imbalance_is_max_over_mean() -> None:
    assert expert_load_imbalance([5, 5, 5, 5]) == 1.0
    assert expert_load_imbalance([8, 0, 0, 0]) == 4.0
    assert expert_load_imbalance([0, 0]) is None
