"""The soak's report: the records and the load summed up (outcomes, anomalies, bursts,
throughput, latency), and the findings that fail the soak."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

from cluster.bench.soak.load import SoakLoad, SoakSettings
from cluster.bench.soak.outcomes import OUTCOMES, RequestRecord
from cluster.bench.stats import percentiles


def summarize(
    records: list[RequestRecord], load: SoakLoad, settings: SoakSettings, load_s: float
) -> dict[str, Any]:
    outcomes = Counter(r.outcome for r in records)
    anomalies = Counter(a for r in records for a in r.anomalies())
    examples = [{"anomalies": r.anomalies(), **asdict(r)} for r in records if r.anomalies()][:10]
    aborts = [r for r in records if r.outcome == "abort"]
    success = [r for r in records if r.outcome == "success"]
    tokens = sum(r.completion_tokens for r in records if r.outcome in ("success", "abort"))
    return {
        "duration_s": round(load_s, 1),
        "requests": {
            "total": len(records),
            "accepted": sum(r.accepted for r in records),
            **{name: outcomes.get(name, 0) for name in OUTCOMES},
        },
        "finish_reasons": dict(Counter(f for r in success for f in r.finishes)),
        "aborts": {
            "before_first_chunk": sum(r.chunks == 0 for r in aborts),
            "mid_stream": sum(r.chunks > 0 for r in aborts),
        },
        "anomalies": {
            "count": sum(anomalies.values()),
            "by_kind": dict(anomalies),
            "examples": examples,
        },
        "bursts": {
            "size": settings.burst_size,
            "runs": sorted(load.burst_log, key=lambda b: b["at_s"]),
        },
        "peak_in_flight": load.peak_in_flight,
        "completion_tokens": tokens,
        "completion_tokens_per_s": round(tokens / load_s, 1),
        "success_latency_s": _latency([r.end - r.start for r in success]),
    }


def _latency(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {**percentiles(values, (0.5, 0.9, 0.99), 3), "max": round(max(values), 3)}


def findings(report: dict[str, Any], max_rss_growth_pct: float = 5.0) -> list[str]:
    """What the report shows to be wrong; empty when the soak passed."""
    found = []
    requests, anomalies = report["requests"], report["anomalies"]
    if anomalies["count"]:
        found.append(f"{anomalies['count']} anomalies: {anomalies['by_kind']}")
    if requests["rejected"]:
        found.append(f"{requests['rejected']} requests rejected other than by admission control")
    for name, entry in report.get("rss", {}).items():
        if entry["gone"]:
            found.append(f"process {name} went away during the run")
        elif "growth_pct" not in entry:
            found.append(f"{name}: no memory reading at rest after each half to compare")
        elif entry["growth_pct"] >= max_rss_growth_pct:
            found.append(
                f"{name}: held memory at rest grew {entry['growth_pct']} % between the halves"
            )
    readiness = report.get("readiness")
    if readiness is not None and readiness["not_ready"]:
        found.append(
            f"GET /health was not 200 in {readiness['not_ready']} of {readiness['probes']} probes"
            f" under load (at s, answer): {readiness['not_ready_at']}"
        )
    for key, when in (("idle_between_halves", "between the halves"), ("idle", "after the run")):
        idle = report.get(key)
        if idle is not None and not idle["reached"]:
            found.append(f"the replicas were not idle {when}: {idle}")
    return found
