"""Nearest-rank percentiles for the benchmarks' latency summaries (one definition, so every
report's p99 means the same thing)."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The value at rank ``int(q * n)`` of the sorted values (the largest for q = 1), 0.0 when
    there are none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def percentiles(values: Sequence[float], qs: Sequence[float], digits: int) -> dict[str, float]:
    """``{"p50": ..., "p99": ...}`` for each quantile in ``qs``, rounded to ``digits``; empty
    when there are no values."""
    if not values:
        return {}
    return {f"p{100 * q:g}": round(percentile(values, q), digits) for q in qs}


__all__ = ["percentile", "percentiles"]
