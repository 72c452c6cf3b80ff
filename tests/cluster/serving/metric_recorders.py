"""Ray metric classes replaced by recorders, for ``ModelMetrics`` tests without Ray: each
recorder checks tags the way Ray does (exactly the declared keys) and the samples render as the
Prometheus text ``GET /metrics`` shows."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.serving import metrics
from cluster.serving.metrics import ModelMetrics

SAMPLES: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}


class _Recorded:
    def __init__(self, name: str, description: str = "", *args: Any, **kwargs: Any) -> None:
        self.name = name
        self.tag_keys = tuple(kwargs.get("tag_keys", ()))
        self.boundaries = list(kwargs.get("boundaries", args[0] if args else []))

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
        name, key = self._key(tags)
        SAMPLES[name + "_count", key] = SAMPLES.get((name + "_count", key), 0) + 1


def recorded_model_metrics(
    monkeypatch: pytest.MonkeyPatch, model: str, replica: str = "r1"
) -> ModelMetrics:
    """A ``ModelMetrics`` whose series land in ``SAMPLES`` (cleared first)."""
    SAMPLES.clear()
    for cls in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, cls, _Recorded)
    return ModelMetrics(model, replica)


def prometheus_text() -> str:
    lines = []
    for (name, tags), value in sorted(SAMPLES.items()):
        labels = ",".join(f'{k}="{v}"' for k, v in tags)
        lines.append(f"{name}{{{labels}}} {value:g}")
    return "\n".join(lines) + "\n"
