"""A node lost mid-generation, on a multi-node Ray on this machine (``ray.cluster_utils.Cluster``:
one raylet per node, each with its own CPUs). Named ``test_ray_*``: it starts its own Ray, so it
must run before the serving modules start the session's (conftest).

    head node  2 CPUs   GCS, Serve's controller, its one HTTP proxy (HeadOnly), the ingress,
                        STEADY's replica: front + head (TP = PP = 1, the head runs the worker)
    node A     3 CPUs   VICTIM's replica: front, head and one worker actor; its raylet is killed
    node C     3 CPUs   spare, added once VICTIM is placed: where Serve puts the replacement

Placement follows from capacity and the order nodes join, with no custom resource: VICTIM needs
three CPU bundles, which the head cannot hold, so it waits for A; A joins only once the ingress
and STEADY are placed on the head, and C once VICTIM is placed on A. Ray marks A dead ~15 s
after the kill; Serve sees the replica gone within seconds.

Asserted: VICTIM's in-flight streams end within 30 s of the kill with an error chunk naming
the model and ``data: [DONE]`` (the official ``openai`` client raises ``APIError`` with that
message, not a connection error), and ``/health`` names it; STEADY's streams, in flight across
the kill, finish with ``length`` and every request to it succeeds throughout; Serve replaces
VICTIM's replica on the spare node and it answers again; afterwards both replicas hold no
per-request state and all their KV blocks are free."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.cluster.conftest import (
    free_port,
    health_checked_model,
    load_yaml,
    simulated_serve_nodes,
    wait_for,
)
from tests.cluster.serving.test_serve_faults import LONG, SSEStream, complete

pytestmark = pytest.mark.slow

APP = "nodes"
VICTIM = "tiny-victim"  # its replica lives on node A, whose raylet is killed
STEADY = "tiny-steady"  # on the head node: must serve throughout
STEADY_TOKENS = 1200  # long enough to be in flight across the kill
ERROR_WITHIN_S = 30
RECOVER_WITHIN_S = 120


def deployment_config(http_port: int) -> Any:
    from cluster.config import load_config

    config = load_yaml("tiny.yaml")
    # VICTIM's worker in an actor of its own: three CPU bundles (front, head, worker).
    config["models"] = [
        health_checked_model(VICTIM, distributed_executor_backend="ray"),
        health_checked_model(STEADY),
    ]
    config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    config["grpc_options"] = None
    config["app_name"] = APP
    return load_config(config)


@dataclass
class Nodes:
    cluster: Any  # ray.cluster_utils.Cluster
    node_a: Any  # ray._private.node.Node, for remove_node
    ids: dict[str, str]  # "head", "A", "C" -> Ray node id
    url: str


def _replica_placed(deployment: str) -> bool:
    """A replica actor of ``deployment`` has been created on a node (so its placement group,
    if it has one, is placed). Serve says RUNNING only once the model has loaded."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    actors = ray.util.list_named_actors(all_namespaces=True)
    found = [(a["name"], a["namespace"]) for a in actors if a["name"].startswith(prefix)]
    if not found:
        return False
    actor = ray.get_actor(found[0][0], namespace=found[0][1])
    ready, _ = ray.wait([actor.__ray_ready__.remote()], timeout=1)
    return bool(ready)


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    from cluster.ops.deploy import deploy
    from cluster.serving.serve import INGRESS_NAME, deployment_name, runtime_env
    from tests.cluster.runtime import compiled_dispatch

    http_port = free_port()
    # The victim's steps go through the Ray Compiled Graph (GPU workers'; CPU workers use
    # plain actor calls): every process of this Ray, the replicas' heads too, runs the hook.
    env = compiled_dispatch.runtime_env(runtime_env())
    with simulated_serve_nodes(2, env, http_port) as cluster, ThreadPoolExecutor(1) as pool:
        deployed = pool.submit(deploy, deployment_config(http_port), lambda _: None)

        def placed(*deployments: str) -> Callable[[], bool]:
            def check() -> bool:
                if deployed.done():
                    deployed.result()  # a deploy failure, raised here
                return all(_replica_placed(d) for d in deployments)

            return check

        # A joins once the ingress and STEADY are placed; VICTIM loads beside STEADY.
        wait_for(placed(INGRESS_NAME, deployment_name(STEADY)), 120, "STEADY placed")
        node_a = cluster.add_node(num_cpus=3)
        wait_for(placed(deployment_name(VICTIM)), 120, "VICTIM placed on A")
        node_c = cluster.add_node(num_cpus=3)  # spare capacity for the replacement
        deployed.result(timeout=120)
        ids = {"head": cluster.head_node.node_id, "A": node_a.node_id, "C": node_c.node_id}
        yield Nodes(cluster, node_a, ids, f"http://127.0.0.1:{http_port}")


# ---- helpers --------------------------------------------------------------------------------


def server(model: str) -> Any:
    from ray import serve

    from cluster.serving.serve import deployment_name

    return serve.get_deployment_handle(deployment_name(model), APP)


def replica_nodes(deployment: str) -> list[str]:
    """The nodes of the deployment's running replicas, from Serve's controller (what its REST
    API and ``serve status`` report)."""
    from ray.serve.context import _get_global_client

    app = _get_global_client().get_serve_details()["applications"][APP]
    replicas = app["deployments"][deployment]["replicas"]
    return sorted(r["node_id"] for r in replicas if r["state"] == "RUNNING")


def stats(model: str) -> dict[str, Any]:
    return server(model).stats.remote().result(timeout_s=30)


def request_state(model: str) -> dict[str, Any]:
    return server(model).request_state.remote().result(timeout_s=30)


def assert_idle(model: str) -> None:
    state = request_state(model)
    assert all(v == 0 for v in state["head"].values()) and not any(state["workers"]), state
    assert state["kv_free_blocks"] == state["kv_total_blocks"], state


class OpenAIStream:
    """A streamed completion through the official ``openai`` client, on its own thread."""

    def __init__(self, client: openai.OpenAI, model: str, max_tokens: int) -> None:
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        args = (client, model, max_tokens)
        self._thread = threading.Thread(target=self._run, args=args, daemon=True)
        self._thread.start()

    def _run(self, client: openai.OpenAI, model: str, max_tokens: int) -> None:
        try:
            stream = client.completions.create(
                model=model, prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                for choice in chunk.choices:
                    self.finish_reason = choice.finish_reason or self.finish_reason
        except BaseException as exc:
            self.error = exc
        finally:
            self.ended_at = time.monotonic()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"stream still open after {timeout_s} s"


class SteadyRequests:
    """Plain completions to ``model`` through the ``openai`` client, back to back, until
    stopped: each one's outcome (``ok`` or the exception's type and message)."""

    def __init__(self, client: openai.OpenAI, model: str) -> None:
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(client, model), daemon=True)
        self._thread.start()

    def _run(self, client: openai.OpenAI, model: str) -> None:
        while not self._stop.is_set():
            try:
                response = client.completions.create(model=model, prompt="hello", max_tokens=8)
                ok = response.choices[0].finish_reason == "length"
                self.outcomes.append("ok" if ok else f"finish_reason {response.choices[0]}")
            except openai.OpenAIError as exc:
                self.outcomes.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.2)

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(60)
        return self.outcomes


# ---- the test -------------------------------------------------------------------------------


def test_node_killed_mid_generation_fails_its_replica_only_and_serve_replaces_it(
    nodes: Nodes,
) -> None:
    import ray

    from cluster.serving.serve import INGRESS_NAME, deployment_name

    ids = nodes.ids
    assert replica_nodes(deployment_name(VICTIM)) == [ids["A"]]
    assert replica_nodes(deployment_name(STEADY)) == [ids["head"]]
    assert replica_nodes(INGRESS_NAME) == [ids["head"]]
    client = openai.OpenAI(base_url=f"{nodes.url}/v1", api_key="none", max_retries=0,
                           timeout=RECOVER_WITHIN_S)  # fmt: skip
    victim_replica = stats(VICTIM)["replica_id"]
    steady = SteadyRequests(client, STEADY)
    victim_sse = [SSEStream(nodes.url, VICTIM) for _ in range(2)]
    victim_openai = OpenAIStream(client, VICTIM, LONG["max_tokens"])
    for stream in victim_sse:
        assert stream.started.wait(60), "a stream never started"
    wait_for(lambda: stats(VICTIM)["num_running"] >= 3, 60, f"3 running on {VICTIM}", 0.1)
    # STEADY's streams start last, so that they are in flight when the node dies.
    steady_sse = SSEStream(nodes.url, STEADY, max_tokens=STEADY_TOKENS)
    steady_openai = OpenAIStream(client, STEADY, STEADY_TOKENS)
    assert steady_sse.started.wait(60), "a stream never started"

    killed_at = time.monotonic()
    nodes.cluster.remove_node(nodes.node_a, allow_graceful=False)  # SIGKILL: raylet and all
    print(f"node A killed in {time.monotonic() - killed_at:.1f} s")

    # VICTIM's streams: an error chunk naming the model, then [DONE]; never a cut connection.
    for stream in victim_sse:
        stream.join(ERROR_WITHIN_S)
        assert stream.failure is None, stream.failure
        assert stream.status == 200
        assert stream.events[-1] == "[DONE]", stream.events[-3:]
        assert VICTIM in stream.events[-2]["error"]["message"], stream.events[-2]
        assert stream.finish_reasons == []
        assert stream.ended_at - killed_at < ERROR_WITHIN_S
    victim_openai.join(ERROR_WITHIN_S)
    error = victim_openai.error
    assert isinstance(error, openai.APIError), error
    assert not isinstance(error, openai.APIConnectionError), error
    assert VICTIM in error.message and victim_openai.finish_reason is None
    errored_at = time.monotonic()
    print(f"{VICTIM}'s streams ended {errored_at - killed_at:.1f} s after the kill")
    unhealthy = httpx.get(f"{nodes.url}/health", timeout=30)  # until the replacement runs
    assert unhealthy.status_code == 503 and VICTIM in unhealthy.json()["error"]["message"]

    # STEADY's streams, in flight across the kill, finish normally.
    steady_sse.join(RECOVER_WITHIN_S)
    steady_openai.join(RECOVER_WITHIN_S)
    assert steady_sse.failure is None and steady_sse.events[-1] == "[DONE]"
    assert steady_sse.finish_reasons == ["length"], steady_sse.events[-3:]
    assert steady_openai.error is None and steady_openai.finish_reason == "length"
    assert steady_sse.ended_at > killed_at and steady_openai.ended_at > killed_at
    print(f"{STEADY}'s streams ended {steady_sse.ended_at - killed_at:.1f} s after the kill")

    # Serve replaces VICTIM's replica on the spare node; a fresh request succeeds.
    def fresh_request_succeeds() -> bool:
        try:
            left = RECOVER_WITHIN_S - (time.monotonic() - errored_at)
            return complete(nodes.url, VICTIM, timeout_s=max(left, 1)).status_code == 200
        except httpx.TimeoutException:
            return False

    wait_for(fresh_request_succeeds, RECOVER_WITHIN_S, f"{VICTIM} to answer again", 1.0)
    print(f"{VICTIM} answered again {time.monotonic() - killed_at:.1f} s after the kill")
    assert stats(VICTIM)["replica_id"] != victim_replica
    assert replica_nodes(deployment_name(VICTIM)) == [ids["C"]]
    # The GCS marks the raylet dead after its missed health checks (Ray's defaults: ~15-30 s),
    # which can come after Serve has already replaced the dead actor.
    wait_for(
        lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == ids["A"]),
        60, "the GCS to mark node A dead", 1.0,
    )  # fmt: skip

    outcomes = steady.stop()
    assert outcomes and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"]
    assert_idle(STEADY)
    assert_idle(VICTIM)
