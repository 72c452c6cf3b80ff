"""What every soak test asserts of its report (``cluster.bench.soak``)."""

from __future__ import annotations

from typing import Any


def check_terminal_outcomes(report: dict[str, Any], min_success: int) -> None:
    """Every accepted request ended once (success, error or abort), none was refused, no
    anomaly was seen, and at least ``min_success`` succeeded."""
    requests = report["requests"]
    assert report["anomalies"]["count"] == 0, report["anomalies"]
    assert requests["success"] + requests["error"] + requests["abort"] == requests["accepted"]
    assert requests["rejected"] == 0
    assert requests["success"] >= min_success
