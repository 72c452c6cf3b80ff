"""The soak test, CI-sized: configs/tiny.yaml under looping streaming clients (completions and
chat, the official ``openai`` client), a tenth of the requests closed by the client at a random
point of their stream, and every 6 s a burst that tops the burst requests in flight up to 10x
the replica's capacity, for under a minute (``cluster bench soak`` runs the same for as long as
asked). Admission control is on — Serve's ``max_queued_requests`` and the engine's
``max_waiting_requests`` — so a burst is refused with 503 rather than queued without bound. The
soak runs once; each test checks one property of its report (``cluster.bench.soak`` defines the
outcomes and the anomalies).

One replica: on a 2-core CI machine a second would halve each replica's CPU and double the
start-up, and the probe reaches every running replica either way (it calls until each
replica id has answered)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from cluster.bench.soak import ServeProbe, SoakSettings, soak
from tests.cluster.conftest import ServeCluster, load_yaml

APP = "soak"
MODEL = "tiny-llama"
MAX_ONGOING = 32  # configs/tiny.yaml: max_ongoing_requests, max_num_seqs
SETTINGS = SoakSettings(
    duration_s=36,
    warmup_s=12,  # holds the first burst, at 6 s
    clients=40,  # more than the 32 seats: some of them always queue
    cancel_fraction=0.1,
    burst_size=10 * MAX_ONGOING,
    burst_interval_s=6,  # bursts at 6, 12, ..., 30 s: two in each measured half
    prompt_len=(8, 128),
    max_tokens=(4, 64),
    request_timeout_s=60,
    rss_interval_s=0.5,
    seed=7,
)


@pytest.fixture(scope="module")
def report(serve_cluster: ServeCluster) -> dict[str, Any]:
    from ray import serve

    config = load_yaml("tiny.yaml")
    model = config["models"][0]
    assert model["deployment_config"]["max_ongoing_requests"] == MAX_ONGOING
    model["deployment_config"]["max_queued_requests"] = MAX_ONGOING
    model["engine_kwargs"]["max_waiting_requests"] = 8
    url = serve_cluster.deploy(config, APP, "/soak")
    try:
        result = asyncio.run(soak(f"{url}/v1", MODEL, SETTINGS, probe=ServeProbe(APP, MODEL)))
    finally:
        serve.delete(APP)
    print(json.dumps(result, indent=1))  # the whole report, for a failure's captured output
    return result


def test_every_accepted_request_ends_in_exactly_one_terminal_outcome(
    report: dict[str, Any],
) -> None:
    requests = report["requests"]
    assert report["anomalies"]["count"] == 0, report["anomalies"]
    assert requests["success"] + requests["error"] + requests["abort"] == requests["accepted"]
    assert requests["rejected"] == 0
    assert requests["success"] > 100


def test_bursts_above_capacity_are_refused_with_503_overloaded(report: dict[str, Any]) -> None:
    bursts = report["bursts"]["runs"]
    assert len(bursts) == len(SETTINGS.burst_times()) == 5
    assert report["peak_in_flight"] >= SETTINGS.burst_size
    # 32 seats and 32 queue slots: the first, full burst is mostly refused, never queued; the
    # later ones top the burst back up to 320 in flight, so each is refused in part at least.
    assert bursts[0]["sent"] == SETTINGS.burst_size
    assert bursts[0].get("refused", 0) >= SETTINGS.burst_size // 2, bursts[0]
    assert all(burst.get("refused", 0) > 0 for burst in bursts if burst["sent"]), bursts
    refused = sum(burst.get("refused", 0) for burst in bursts)
    assert refused >= sum(burst["sent"] for burst in bursts) // 3, bursts


def test_cancellations_happen_mid_stream(report: dict[str, Any]) -> None:
    aborts = report["aborts"]
    assert aborts["mid_stream"] >= 20
    assert report["requests"]["abort"] == aborts["mid_stream"] + aborts["before_first_chunk"]


def test_once_idle_every_replica_has_every_kv_block_free(report: dict[str, Any]) -> None:
    idle = report["idle"]
    assert idle["reached"], idle
    assert len(idle["replicas"]) == 1
    for replica in idle["replicas"]:
        assert replica["kv_free_blocks"] == replica["kv_total_blocks"] == 256


def test_once_idle_no_request_state_remains_on_the_head_or_the_workers(
    report: dict[str, Any],
) -> None:
    for replica in report["idle"]["replicas"]:
        assert replica["head"] and all(n == 0 for n in replica["head"].values()), replica
        assert replica["workers"] == [0], replica


def test_resident_memory_grows_under_5_percent_between_the_halves(
    report: dict[str, Any],
) -> None:
    rss = report["rss"]
    assert {name.split("#")[0] for name in rss} == {f"LLMServer:{MODEL}", "OpenAIIngress", "proxy"}
    for name, entry in rss.items():
        assert not entry["gone"], f"{name} went away during the run"
        assert entry["growth_pct"] < 5.0, (name, entry)


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow
