"""Model start-up on a local Ray whose worker processes load slowly (``slow_loader``: 0.4 s per
checkpoint tensor, ~8 s for tiny-llama's 21, unless a test says otherwise): start-up is bounded by
``LLM_CLUSTER_LOAD_TIMEOUT_S``, not the step timeout; TP ranks load at once; each worker's
progress is published while it loads and gone once the engine runs; and a Serve replica that is
starting shows its load in ``cluster_status``, while ``/health`` says the model is not ready.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from cluster.runtime.load_progress import read_load_progress
from engine import LLM, EngineDeadError, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.worker.model_loader import checkpoint_tensor_bytes
from tests.cluster.conftest import free_port, load_yaml
from tests.cluster.runtime import slow_loader

MODEL = "builtin:tiny-llama"
NUM_TENSORS = 21  # in tiny-llama's checkpoint
DELAY_S = 0.4  # per tensor: ~8.4 s per worker
ENGINE_ARGS: dict[str, Any] = {"num_kv_blocks": 64, "max_model_len": 128, "device": "cpu"}
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["hello", "the quick brown fox"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def delay_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("slow_loader") / "seconds_per_tensor"
    slow_loader.set_delay(path, DELAY_S)
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=slow_loader.runtime_env(path),
    )
    yield path
    ray.shutdown()


@pytest.fixture(autouse=True)
def default_delay(delay_file: Path) -> None:
    slow_loader.set_delay(delay_file, DELAY_S)


def _our_answer(url: str, deadline: float) -> httpx.Response:
    """GET ``url`` once the ingress answers it (Serve's proxy routes the app only once the
    ingress replica runs; before that, its own 404 / 503 without our error body)."""
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url, timeout=30)
            if response.status_code == 200 or "code" in response.json().get("error", {}):
                return response
        except (httpx.TransportError, ValueError, AttributeError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"the ingress never answered {url}")


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


class _Poller:
    """Reads the published load progress every 0.2 s on a thread, keeping what it saw."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.seen.extend(read_load_progress())

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        return self.seen


def test_tp2_load_longer_than_the_step_timeout_starts_loading_ranks_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference = LLM(MODEL, distributed_executor_backend="uni", **ENGINE_ARGS)  # not slowed
    expected = _greedy(reference)
    reference.llm_engine.shutdown()
    monkeypatch.setenv("LLM_CLUSTER_STEP_TIMEOUT_S", "3")

    poller = _Poller()
    llm = LLM(MODEL, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_ARGS)
    seen = poller.stop()
    try:
        one_worker_s = NUM_TENSORS * DELAY_S
        load_s = llm.llm_engine.executor.startup_timings["load"]
        # Both ranks read at once: about one worker's time, far from the sum of both.
        assert one_worker_s <= load_s < 1.5 * one_worker_s, load_s
        assert _greedy(llm) == expected
        loading = [r for r in seen if r["phase"] == "loading weights"]
        assert {r["rank"] for r in loading} == {0, 1}
        assert any(0 < r["bytes_read"] < r["bytes_total"] for r in loading)
        assert read_load_progress() == []  # ready: every record removed
    finally:
        llm.llm_engine.shutdown()


def test_a_load_past_the_load_timeout_fails_naming_phase_ranks_and_variable(
    monkeypatch: pytest.MonkeyPatch, delay_file: Path
) -> None:
    # 63 s of loading against a 30 s bound per phase: worker processes took over 20 s to start
    # (init_device) on a 2-core machine busy with other tests.
    slow_loader.set_delay(delay_file, 3.0)
    monkeypatch.setenv("LLM_CLUSTER_LOAD_TIMEOUT_S", "30")
    started = time.monotonic()
    with pytest.raises(EngineDeadError) as failure:
        LLM(MODEL, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_ARGS)
    message = str(failure.value)
    assert "start-up phase 'loading weights'" in message
    assert "worker ranks [0, 1]" in message
    assert "LLM_CLUSTER_LOAD_TIMEOUT_S" in message
    assert time.monotonic() - started < NUM_TENSORS * 3.0  # it did not wait for the load
    time.sleep(2.5)  # the executor removes its killed workers' records twice, 2 s apart
    assert read_load_progress() == []


def test_a_starting_replica_shows_its_load_and_health_is_not_ready_until_it_serves(
    monkeypatch: pytest.MonkeyPatch, delay_file: Path
) -> None:
    """``cluster status`` shows the worker's load while the replica starts; meanwhile
    ``/health`` (readiness) answers at once with a 503 naming the model and its phase, and
    ``/livez`` (liveness) 200; once the replica runs, ``/health`` is 200."""
    slow_loader.set_delay(delay_file, 1.0)  # ~21 s of loading: the ingress is up well before
    from openai import OpenAI

    # The slow loader is a Ray worker-process hook: the head's engine must load in its Ray
    # worker, not in an engine-core child (whose relay of the same records is tested in
    # tests/engine/client/test_core_process.py). ``build_app`` forwards this to the replicas.
    monkeypatch.setenv("LLM_CLUSTER_HEAD_CORE_PROCESS", "0")

    from cluster.config import load_config
    from cluster.ops import deploy

    raw = load_yaml("tiny.yaml")
    raw["http_options"]["port"] = free_port()
    raw.pop("grpc_options")
    raw["app_name"] = "slowload"
    config = load_config(raw)
    lines: list[str] = []
    raised: list[str] = []

    def run_deploy() -> None:
        try:
            deploy.deploy(config, lines.append, 0.5)
        except BaseException:  # named by the assertions below, not lost in the thread
            raised.append(traceback.format_exc())

    deployer = threading.Thread(target=run_deploy)
    started = time.monotonic()
    deployer.start()
    try:
        loading: list[dict[str, Any]] = []
        phases: list[str] = []
        status: dict[str, Any] = {}
        deadline = started + 300  # a replica may wait long for a CPU on a busy 2-core machine
        while deployer.is_alive() and time.monotonic() < deadline and not loading:
            status = deploy.cluster_status("slowload")
            entry = status["models"].get("tiny-llama", {})
            phases.extend(w["phase"] for w in entry.get("loading", []) if w["phase"] not in phases)
            loading = [
                w
                for w in entry.get("loading", [])
                if w["phase"] == "loading weights" and 0 < w["bytes_read"] < w["bytes_total"]
            ]
            time.sleep(0.3)
        state = "is waiting" if deployer.is_alive() else f"ended, raising {''.join(raised)}"
        assert loading, (
            f"no record of a load under way seen while the replica started: after "
            f"{time.monotonic() - started:.0f} s deploy {state}; phases seen {phases}; "
            f"deploy printed {lines}; last status {status}"
        )
        base_url = deploy.endpoint(config).removesuffix("/v1")
        asked = time.monotonic()
        health = _our_answer(f"{base_url}/health", deadline)
        assert time.monotonic() - asked < 5  # it does not wait for the load
        assert deployer.is_alive(), "the replica finished loading: the check came too late"
        assert health.status_code == 503, health.text
        error = health.json()["error"]
        assert error["code"] == "not_ready", error
        assert error["message"].startswith("tiny-llama: not ready: no replica running yet ("), error
        assert httpx.get(f"{base_url}/livez", timeout=10).json() == {"status": "ok"}
        worker = loading[0]
        assert worker["rank"] == 0 and worker["node"] and 0 < worker["percent"] < 100
        checkpoint = checkpoint_tensor_bytes(resolve_model_source(MODEL))
        assert worker["bytes_total"] == sum(checkpoint.values())
        deployer.join(timeout=120)
        assert not raised, "".join(raised)
        status = deploy.cluster_status("slowload")
        assert status["status"] == "RUNNING"
        assert "loading" not in status["models"]["tiny-llama"]
        client = OpenAI(base_url=deploy.endpoint(config), api_key="unused")
        reply = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=4)
        assert reply.choices[0].text is not None and reply.usage.completion_tokens == 4
        assert httpx.get(f"{base_url}/health", timeout=30).json() == {"status": "ok"}
    finally:
        deployer.join(timeout=120)
        deploy.shutdown()
