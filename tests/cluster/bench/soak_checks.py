"""What every soak test asserts of its report (``cluster.bench.soak``)."""

from __future__ import annotations

import json
from typing import Any


def check_terminal_outcomes(report: dict[str, Any], min_success: int) -> None:
    """Every accepted request ended once (success, error or abort), none was refused, no
    anomaly was seen, and at least ``min_success`` succeeded."""
    requests = report["requests"]
    assert report["anomalies"]["count"] == 0, report["anomalies"]
    assert requests["success"] + requests["error"] + requests["abort"] == requests["accepted"]
    assert requests["rejected"] == 0
    assert requests["success"] >= min_success


def check_held_memory(report: dict[str, Any], deployment: str, replicas: int) -> None:
    """The ingress, Serve's proxy and each of the ``replicas`` of ``deployment`` stayed up,
    and each one's held memory at rest grew under 5 % between the halves."""
    rss = report["rss"]
    names = sorted(name.split("#")[0] for name in rss)
    assert names == sorted(["OpenAIIngress", "proxy", *[deployment] * replicas]), names
    for name, entry in rss.items():
        assert not entry["gone"], f"{name} went away during the run"
        # The whole entry, its series included (pytest shortens a tuple's repr, not a string).
        assert entry.get("growth_pct", 100.0) < 5.0, f"{name}: {json.dumps(entry)}"


def check_idle(report: dict[str, Any], replicas: int) -> None:
    """At each rest (after each half) all ``replicas`` went idle: every KV block free, no
    request state on the head or the workers."""
    for point in ("idle_between_halves", "idle"):
        idle = report[point]
        assert idle["reached"], (point, idle)
        assert len(idle["replicas"]) == replicas, (point, idle)
        for replica in idle["replicas"]:
            assert replica["kv_free_blocks"] == replica["kv_total_blocks"] == 256, point
            assert replica["head"] and all(n == 0 for n in replica["head"].values()), replica
            assert replica["workers"] == [0], replica
