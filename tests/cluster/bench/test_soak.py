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
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.bench.soak import ServeProbe, SoakSettings, soak
from tests.cluster.bench.soak_checks import (
    check_held_memory,
    check_idle,
    check_terminal_outcomes,
)
from tests.cluster.conftest import CONFIGS, ServeCluster, load_yaml

APP = "soak"
MODEL = "tiny-llama"
MAX_ONGOING = 32  # configs/tiny.yaml: max_ongoing_requests, max_num_seqs
SETTINGS = SoakSettings(
    duration_s=36,
    warmup_s=12,  # holds the first burst, at 6 s
    clients=40,  # more than the 32 seats: some of them always queue
    cancel_fraction=0.1,
    burst_size=10 * MAX_ONGOING,
    burst_interval_s=6,  # bursts at 6, 12 and 18 s, then 24 and 30: the halves split at 24
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
    check_terminal_outcomes(report, min_success=101)


def test_bursts_above_capacity_are_refused_with_503_overloaded(report: dict[str, Any]) -> None:
    bursts = report["bursts"]["runs"]
    assert len(bursts) == len(SETTINGS.burst_times()) == 5
    assert report["peak_in_flight"] >= SETTINGS.burst_size
    # 32 seats and 32 queue slots: much of the first, full burst is refused, never queued (how
    # much depends on how many requests end while it is sent: 147-250 of 320 seen, the fewest on
    # a loaded CI machine); the later ones top the burst back up to 320 in flight, and each that
    # alone sends more than the seats and slots is refused in part at least (a small top-up may
    # fit what has freed up).
    assert bursts[0]["sent"] == SETTINGS.burst_size
    assert bursts[0].get("refused", 0) >= SETTINGS.burst_size // 3, bursts[0]
    over = [burst for burst in bursts if burst["sent"] > 2 * MAX_ONGOING]
    assert all(burst.get("refused", 0) > 0 for burst in over), bursts
    refused = sum(burst.get("refused", 0) for burst in bursts)
    assert refused >= sum(burst["sent"] for burst in bursts) // 3, bursts


def test_readiness_stays_200_while_every_seat_is_taken(report: dict[str, Any]) -> None:
    """``GET /health`` every second, as a readiness probe asks it, while 40 clients hold the 32
    seats and bursts fill the queue behind them: always 200. (Asking the replica, Serve queues
    the health call behind the streams or refuses it with the queue full: 6 of 18 probes were
    503 before.)"""
    readiness = report["readiness"]
    # A probe a second whether or not the last has answered: the count follows the run's
    # length, not the latency.
    assert readiness["probes"] >= SETTINGS.duration_s // 2, readiness
    assert readiness["not_ready"] == 0, readiness


def test_cancellations_happen_mid_stream(report: dict[str, Any]) -> None:
    aborts = report["aborts"]
    assert aborts["mid_stream"] >= 20
    assert report["requests"]["abort"] == aborts["mid_stream"] + aborts["before_first_chunk"]


def test_once_idle_after_each_half_no_kv_block_or_request_state_is_held(
    report: dict[str, Any],
) -> None:
    check_idle(report, replicas=1)


def test_held_memory_at_rest_grows_under_5_percent_between_the_halves(
    report: dict[str, Any],
) -> None:
    check_held_memory(report, f"LLMServer:{MODEL}", replicas=1)


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow


# ---- ``cluster bench soak --config``: its own Ray, as the README runs it --------------------


def _soak_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    from tests.cluster.cli.test_cli_serving import ROOT, cli_env

    command = [sys.executable, "-m", "cluster.cli", "bench", "soak", *args]
    return subprocess.run(command, cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_soak_refuses_a_port_in_use_before_starting_ray(tmp_path: Path) -> None:
    config = load_yaml("tiny.yaml")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        config["http_options"]["port"] = holder.getsockname()[1]
        path = tmp_path / "tiny.yaml"
        path.write_text(yaml.safe_dump(config))
        result = _soak_cli("--config", str(path), timeout=60)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: http_options.port {config['http_options']['port']} "), last
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.slow
def test_soak_on_its_own_ray_prints_the_json_report_alone() -> None:
    """Its stdout is the report and nothing else (``| jq`` works): stopping its Ray printed
    Ray's "Task ServeController... failed" there first."""
    short = ["--duration", "8", "--warmup", "2", "--clients", "2", "--burst-size", "4",
             "--burst-interval", "4", "--max-tokens", "4:16", "--rss-interval", "2"]  # fmt: skip
    result = _soak_cli("--config", str(CONFIGS / "tiny.yaml"), "--free-ports", *short)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["findings"] == [] and report["conditions"]["duration_s"] == 8
