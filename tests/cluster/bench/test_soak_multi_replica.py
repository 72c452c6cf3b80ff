"""The soak (``cluster.bench.soak``) against 2 replicas behind the prefix-aware router:
looping streaming clients, cancellations, bursts above capacity with admission control on,
and the same guarantees as the one-replica soak (``test_soak.py``) — every accepted request
ends in exactly one terminal outcome, once idle every replica has every KV block free and no
request state left, and no process's held memory grows between the halves. Shorter than the
one-replica soak: on a 2-core machine two replicas share the cores, and the properties are the
same ones."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pytest

from cluster.bench.soak import ServeProbe, soak
from tests.cluster.bench.soak_checks import (
    check_held_memory,
    check_idle,
    check_terminal_outcomes,
)
from tests.cluster.bench.test_soak import MAX_ONGOING, MODEL, SETTINGS
from tests.cluster.conftest import ServeCluster, load_yaml

APP = "soak2"
MULTI_SETTINGS = replace(SETTINGS, duration_s=16, warmup_s=5, burst_interval_s=5)


@pytest.fixture(scope="module")
def report(serve_cluster: ServeCluster) -> dict[str, Any]:
    from ray import serve

    config = load_yaml("tiny.yaml")
    model = config["models"][0]
    model["deployment_config"]["num_replicas"] = 2  # max_replicas 2: prefix-aware by default
    model["deployment_config"]["max_queued_requests"] = MAX_ONGOING
    model["engine_kwargs"]["max_waiting_requests"] = 8
    url = serve_cluster.deploy(config, APP, f"/{APP}")
    try:
        probe = ServeProbe(APP, MODEL)
        result = asyncio.run(soak(f"{url}/v1", MODEL, MULTI_SETTINGS, probe=probe))
    finally:
        serve.delete(APP)
    print(json.dumps(result, indent=1))
    return result


def test_every_accepted_request_ends_in_exactly_one_terminal_outcome(
    report: dict[str, Any],
) -> None:
    check_terminal_outcomes(report, min_success=51)


def test_once_idle_after_each_half_both_replicas_hold_no_kv_block_or_request_state(
    report: dict[str, Any],
) -> None:
    check_idle(report, replicas=2)


def test_held_memory_at_rest_grows_under_5_percent_between_the_halves(
    report: dict[str, Any],
) -> None:
    check_held_memory(report, f"LLMServer:{MODEL}", replicas=2)


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow
