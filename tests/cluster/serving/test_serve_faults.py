"""Fault injection on a live deployment (a real local Ray and Serve): a worker actor of a TP
group killed mid-generation, the model's head actor (its engine core) killed mid-generation,
its ``LLMServer`` replica (the front, which owns the head) killed mid-generation, and the
graceful drain of a replica that Serve stops (redeploy, ``cluster shutdown``).

For each fault, every in-flight request of the model ends with a clear error within 30 s —
a 503 body for a plain request, an error chunk then ``data: [DONE]`` for a stream, UNAVAILABLE
for gRPC —, ``/health`` reports the model, Serve replaces the replica and a fresh request
succeeds within 120 s, and another model of the same application serves throughout. (A
data-parallel gang's rank killed, on simulated nodes: ``tests/cluster/runtime/
test_ray_gang_failure.py``, with ``run_fault``.)"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import pytest

from cluster.proto import llm_pb2, llm_pb2_grpc
from engine.builtin.tiny_models import tiny_variant
from tests.cluster.conftest import ServeCluster, health_checked_model, load_yaml, wait_for

APP = "faults"
PREFIX = "/faults"
FAULTY = "tiny-tp2"  # tensor-parallel over two worker actors: the model faults are injected in
STEADY = "tiny-llama"  # TP = 1, its head runs the worker: must keep serving throughout
LONG = {"max_tokens": 1500, "temperature": 0, "ignore_eos": True}
ERROR_WITHIN_S = 30
RECOVER_WITHIN_S = 120


def fault_config() -> dict[str, Any]:
    config = load_yaml("tiny.yaml")
    config["models"] = [
        health_checked_model(FAULTY, tensor_parallel_size=2),
        health_checked_model(STEADY),
    ]
    return config


@pytest.fixture(scope="module")
def base_url(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    url = serve_cluster.deploy(fault_config(), APP, PREFIX)
    yield url
    serve.delete(APP)


@pytest.fixture(scope="module")
def grpc_stub(serve_cluster: ServeCluster, base_url: str) -> Iterator[llm_pb2_grpc.LLMStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{serve_cluster.grpc_port}")
    yield llm_pb2_grpc.LLMStub(channel)
    channel.close()


# ---- clients --------------------------------------------------------------------------------


def complete(base_url: str, model: str, timeout_s: float = 60, **params: Any) -> httpx.Response:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, **params}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)


class SSEStream:
    """A raw streaming completion on its own thread: every ``data:`` payload, in order."""

    def __init__(self, base_url: str, model: str, **params: Any) -> None:
        self.events: list[Any] = []
        self.started = threading.Event()
        self.ended_at: float | None = None
        self.failure: BaseException | None = None
        body = {"model": model, "prompt": "Once upon a time", "stream": True, **LONG, **params}
        self._thread = threading.Thread(target=self._run, args=(base_url, body), daemon=True)
        self._thread.start()

    def _run(self, base_url: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", f"{base_url}/v1/completions", json=body,
                              timeout=120) as response:  # fmt: skip
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        except BaseException as exc:  # a severed connection is a failure of the contract
            self.failure = exc
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"stream still open after {timeout_s} s"

    @property
    def finish_reasons(self) -> list[str]:
        return [
            c["finish_reason"]
            for e in self.events
            if isinstance(e, dict) and "choices" in e
            for c in e["choices"]
            if c.get("finish_reason")
        ]


def grpc_generate(stub: llm_pb2_grpc.LLMStub, model: str, app: str = APP) -> list[Any]:
    request = llm_pb2.GenerateRequest(model=model, prompt="Once upon a time", max_tokens=1500,
                                      temperature=0, ignore_eos=True)  # fmt: skip
    return list(stub.Generate(request, metadata=(("application", app),), timeout=120))


class SteadyTraffic:
    """Requests to the other model, back to back, on a thread, until stopped."""

    def __init__(self, base_url: str) -> None:
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base_url,), daemon=True)
        self._thread.start()

    def _run(self, base_url: str) -> None:
        while not self._stop.is_set():
            try:
                self.statuses.append(complete(base_url, STEADY, timeout_s=30).status_code)
            except httpx.HTTPError:
                self.statuses.append(-1)
            time.sleep(0.2)

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(60)
        return self.statuses


# ---- Ray-side helpers ------------------------------------------------------------------------


def named_actors(prefix: str) -> list[tuple[str, str]]:
    """(name, namespace) of the live named actors whose name starts with ``prefix``. Replicas
    live in Serve's namespace, the workers a replica starts in its job's."""
    import ray

    return sorted(
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    )


def kill(actor: tuple[str, str]) -> None:
    import ray

    ray.kill(ray.get_actor(actor[0], namespace=actor[1]), no_restart=True)


def server_handle(model: str, app: str = APP) -> Any:
    from ray import serve

    from cluster.serving.serve import deployment_name

    return serve.get_deployment_handle(deployment_name(model), app)


def request_state(model: str, app: str = APP) -> dict[str, Any]:
    return server_handle(model, app).request_state.remote().result(timeout_s=30)


def health(base_url: str) -> httpx.Response:
    return httpx.get(f"{base_url}/health", timeout=30)


def wait_for_running(model: str, count: int, app: str = APP) -> None:
    wait_for(
        lambda: (
            server_handle(model, app).stats.remote().result(timeout_s=30)["num_running"] >= count
        ),
        60,
        f"{count} running requests on {model}",
        poll_s=0.1,
    )


# ---- the fault scenario, for either victim ----------------------------------------------------


def run_fault(
    base_url: str,
    stub: llm_pb2_grpc.LLMStub,
    inject: Callable[[], None],
    model: str = FAULTY,
    app: str = APP,
) -> None:
    """Requests of every kind in flight on ``model`` (application ``app``, beside ``STEADY``)
    when ``inject`` runs; then the contract in the module docstring."""
    from cluster.serving.serve import deployment_name

    wait_for(lambda: health(base_url).status_code == 200, RECOVER_WITHIN_S, "a healthy app")
    fronts = f"SERVE_REPLICA::{app}#{deployment_name(model)}#"
    fronts_before = set(named_actors(fronts))
    steady = SteadyTraffic(base_url)
    streams = [SSEStream(base_url, model) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        plain: Future[httpx.Response] = pool.submit(complete, base_url, model, 120, **LONG)
        rpc: Future[list[Any]] = pool.submit(grpc_generate, stub, model, app)
        for stream in streams:
            assert stream.started.wait(60), "the stream never started"
        wait_for_running(model, 4, app)

        injected_at = time.monotonic()
        inject()

        # Every in-flight request ends with a clear error within 30 s.
        response = plain.result(ERROR_WITHIN_S)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert model in error["message"] and error["type"] == "ServiceUnavailableError"
        for stream in streams:
            stream.join(ERROR_WITHIN_S)
            assert stream.failure is None, stream.failure
            assert stream.status == 200
            assert stream.events[-1] == "[DONE]"
            assert model in stream.events[-2]["error"]["message"]
            assert stream.ended_at - injected_at < ERROR_WITHIN_S
        with pytest.raises(grpc.RpcError) as rpc_error:
            rpc.result(ERROR_WITHIN_S)
        assert rpc_error.value.code() == grpc.StatusCode.UNAVAILABLE
        errored_at = time.monotonic()

    # /health names the model until Serve has replaced the replica ... (it waits up to 10 s
    # for a replica to answer: one that answers healthy must be the replacement)
    unhealthy = health(base_url)
    if unhealthy.status_code == 200:
        assert set(named_actors(fronts)) - fronts_before, "healthy, with no new replica"
    else:
        assert unhealthy.status_code == 503, unhealthy.text
        assert model in unhealthy.json()["error"]["message"]

    # ... which it does: a fresh request succeeds within 120 s.
    def fresh_request_succeeds() -> bool:
        try:  # a request may wait for the replacement replica: give it the time left
            left = RECOVER_WITHIN_S - (time.monotonic() - errored_at)
            return complete(base_url, model, timeout_s=max(left, 1)).status_code == 200
        except httpx.TimeoutException:
            return False

    wait_for(
        fresh_request_succeeds,
        RECOVER_WITHIN_S - (time.monotonic() - errored_at),
        f"a fresh request to {model} to succeed",
        poll_s=1.0,
    )
    assert health(base_url).status_code == 200
    statuses = steady.stop()
    assert statuses and set(statuses) == {200}, statuses  # the other model never failed
    state = request_state(model, app)
    assert all(v == 0 for v in state["head"].values()) and not any(state["workers"]), state
    assert state["kv_free_blocks"] == state["kv_total_blocks"]


def test_worker_actor_killed_mid_generation(base_url: str, grpc_stub: llm_pb2_grpc.LLMStub) -> None:
    from cluster.runtime.ray_executor import WORKER_NAME_PREFIX

    prefix = f"{WORKER_NAME_PREFIX}{FAULTY}:"
    workers = named_actors(prefix)
    assert len(workers) == 2, workers  # the TP = 2 model's two ranks
    run_fault(base_url, grpc_stub, lambda: kill(workers[-1]))
    # The replacement replica brought up new workers; the killed one is gone.
    assert workers[-1] not in named_actors(prefix)
    assert len(named_actors(prefix)) == 2


def test_head_actor_killed_mid_generation(base_url: str, grpc_stub: llm_pb2_grpc.LLMStub) -> None:
    from cluster.serving.head_actor import HEAD_NAME_PREFIX

    heads = named_actors(f"{HEAD_NAME_PREFIX}{FAULTY}:")
    assert len(heads) == 1, heads
    run_fault(base_url, grpc_stub, lambda: kill(heads[0]))
    # The replica whose head died failed its health check and was replaced, head and all.
    assert named_actors(f"{HEAD_NAME_PREFIX}{FAULTY}:") not in ([], heads)


def test_front_replica_killed_mid_generation(
    base_url: str, grpc_stub: llm_pb2_grpc.LLMStub
) -> None:
    from cluster.serving.serve import deployment_name

    prefix = f"SERVE_REPLICA::{APP}#{deployment_name(FAULTY)}#"
    heads = named_actors(prefix)
    assert len(heads) == 1, heads
    run_fault(base_url, grpc_stub, lambda: kill(heads[0]))
    assert named_actors(prefix) not in ([], heads)  # a new replica took its place


# ---- graceful drain ---------------------------------------------------------------------------

DRAIN_APP = "drain"
DRAIN_MODEL = "tiny-drain"
DRAIN_TIMEOUT_S = 3
DRAIN_MAX_MODEL_LEN = 16384


def test_deleting_the_app_drains_in_flight_requests(serve_cluster: ServeCluster) -> None:
    """What ``cluster shutdown`` and a redeploy do to a replica: Serve stops it. In-flight
    requests that finish within ``graceful_shutdown_timeout_s`` finish normally; the rest end
    with finish_reason "abort" (a last chunk, then ``[DONE]``), never a severed stream."""
    from ray import serve

    config = load_yaml("tiny.yaml")
    # Room for a request that no machine decodes within the drain timeout (the built-in allows
    # 2,048 positions, which a fast moment of a 2-core VM decoded in under 3 s).
    source = tiny_variant("tiny-llama", max_position_embeddings=DRAIN_MAX_MODEL_LEN)
    model = health_checked_model(DRAIN_MODEL, max_model_len=DRAIN_MAX_MODEL_LEN,
                                 num_kv_blocks=2 * DRAIN_MAX_MODEL_LEN // 16)  # fmt: skip
    model["model_loading_config"]["model_source"] = str(source)
    model["deployment_config"]["graceful_shutdown_timeout_s"] = DRAIN_TIMEOUT_S
    config["models"] = [model]
    url = serve_cluster.deploy(config, DRAIN_APP, "/drain")
    try:
        # Warm up, and measure this machine's decode speed to size a request that finishes
        # well inside the drain timeout.
        start = time.monotonic()
        assert complete(url, DRAIN_MODEL, max_tokens=64, ignore_eos=True).status_code == 200
        per_token_s = (time.monotonic() - start) / 64
        short_tokens = max(8, min(400, int(0.5 / per_token_s)))  # about half a second
        print(f"drain test: {per_token_s * 1000:.1f} ms per token, short request {short_tokens}")
        # The long one must outlast the drain timeout several times over. The measured time per
        # token includes the request's own overhead, so it overstates it: hence the factor 4.
        long_tokens = max(2000, int(4 * (DRAIN_TIMEOUT_S + 5) / per_token_s))
        long_tokens = min(DRAIN_MAX_MODEL_LEN - 64, long_tokens)
        print(f"drain test: long request {long_tokens}")
        long = SSEStream(url, DRAIN_MODEL, max_tokens=long_tokens)
        short = SSEStream(url, DRAIN_MODEL, max_tokens=short_tokens)
        assert long.started.wait(60) and short.started.wait(60)
        stop_at = time.monotonic()
        serve.delete(DRAIN_APP, _blocking=False)
        short.join(DRAIN_TIMEOUT_S + 30)
        long.join(DRAIN_TIMEOUT_S + 30)
        for stream in (short, long):
            assert stream.failure is None, stream.failure
            assert stream.events[-1] == "[DONE]", stream.events[-3:]
            errors = [e for e in stream.events if isinstance(e, dict) and "error" in e]
            assert not errors, errors
        assert short.finish_reasons == ["length"]
        assert long.finish_reasons == ["abort"]
        # The leftover was cut at the drain timeout, not later and not at once.
        assert DRAIN_TIMEOUT_S - 1 < long.ended_at - stop_at < DRAIN_TIMEOUT_S + 5
    finally:
        serve.delete(DRAIN_APP)


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow
