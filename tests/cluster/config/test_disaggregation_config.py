"""A model's ``disaggregation`` section: its two pools as models of their own (engine_kwargs
over the model's, the connector's role set), their Serve deployments, what is refused (naming
the key path); and the ingress's prefill hop against scripted handles: a prefill that ends, is
refused, dies or outlasts its timeout never fails the request."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from cluster.api.replica_messages import GenerateRequest, StreamError, StreamStart
from cluster.config import load_config
from cluster.serving.ingress_prefill import prefill, prefill_request
from engine.config import ConfigError

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def pd_config(**disaggregation: Any) -> dict[str, Any]:
    data = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    model = data["models"][0]
    del model["deployment_config"]  # each pool has its own
    model["disaggregation"] = {
        "prefill": {"engine_kwargs": {"max_num_seqs": 8},
                    "deployment_config": {"num_replicas": 2}},
        "decode": {"deployment_config": {"autoscaling_config": {"min_replicas": 1,
                                                                "max_replicas": 3}}},
        **disaggregation,
    }  # fmt: skip
    return data


def test_pools_are_models_of_their_own_with_the_connector_roles() -> None:
    config = load_config(pd_config(prefill_timeout_s=5))
    (model,) = config.models
    (prefill_role, prefill), (decode_role, decode) = model.pools()
    assert (prefill_role, decode_role) == ("prefill", "decode")
    assert prefill.engine_kwargs["max_num_seqs"] == 8  # the pool's over the model's
    assert decode.engine_kwargs["max_num_seqs"] == 32
    assert prefill.engine_kwargs["kv_transfer_config"] == {
        "kv_connector": "SharedStorageConnector", "kv_role": "kv_producer"}  # fmt: skip
    assert decode.engine_kwargs["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert prefill.deployment_config.max_replicas == 2
    assert decode.deployment_config.max_replicas == 3
    # Prefill routed by its prefix cache, decode by load.
    assert prefill.deployment_config.router == "prefix_aware"
    assert decode.deployment_config.router == "pow2"
    # Both pools at their largest: what a local Ray must offer.
    per_replica = 2.0  # the front and the head
    assert model.cpus_at_max_scale() == per_replica * (2 + 3)
    assert model.disaggregation is not None and model.disaggregation.prefill_timeout_s == 5


def test_each_pool_deploys_under_its_own_name() -> None:
    from cluster.serving.serve import build_app

    app = build_app(pd_config())
    ingress_args = app._bound_deployment.init_args  # (servers, ..., prefill)
    servers, prefill = ingress_args[0], ingress_args[6]
    assert list(servers) == ["tiny-llama"] and list(prefill) == ["tiny-llama"]
    decode = servers["tiny-llama"]._bound_deployment
    assert decode.name == "LLMServer:tiny-llama" and decode.init_args[0] == "tiny-llama"
    app_of_prefill, timeout_s, connector = prefill["tiny-llama"]
    assert connector == "SharedStorageConnector"
    prefill_pool = app_of_prefill._bound_deployment
    assert prefill_pool.name == "LLMServer:tiny-llama:prefill"
    assert prefill_pool.init_args[0] == "tiny-llama:prefill" and timeout_s == 30.0
    assert prefill_pool.init_args[1]["kv_transfer_config"]["kv_role"] == "kv_producer"


def test_a_decode_pool_that_scales_to_zero_gets_the_cold_start_answer() -> None:
    """The model's name routes to its decode pool: at zero replicas there, a request gets
    the pool's ``cold_start_timeout_s`` (then 503 cold_start) and /health skips the model."""
    from cluster.serving.serve import build_app

    data = pd_config(decode={"deployment_config": {
        "autoscaling_config": {"min_replicas": 0, "max_replicas": 2},
        "cold_start_timeout_s": 12}})  # fmt: skip
    cold_start = build_app(data)._bound_deployment.init_args[4]
    assert cold_start == {"tiny-llama": 12}


def test_a_prefill_pool_at_zero_replicas_is_not_the_model_at_zero() -> None:
    from cluster.serving.serve import build_app

    data = pd_config(prefill={"deployment_config": {
        "autoscaling_config": {"min_replicas": 0, "max_replicas": 2}}})  # fmt: skip
    assert build_app(data)._bound_deployment.init_args[4] == {}


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"decode": {"engine_kwargs": {"block_size": 32}}},
         "models[0].disaggregation.decode.engine_kwargs.block_size: must equal the prefill"),
        ({"decode": {"engine_kwargs": {"pipeline_parallel_size": 2}}},
         "models[0].disaggregation.decode.engine_kwargs.pipeline_parallel_size"),
        ({"prefill": {"engine_kwargs": {"kv_transfer_config": {
            "kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer"}}}},
         "models[0].disaggregation.prefill.engine_kwargs.kv_transfer_config.kv_role: is "
         "'kv_producer'"),
        ({"prefill": {"engine_kwargs": {"kv_transfer_config": "SharedStorageConnector"}}},
         "models[0].disaggregation.prefill.engine_kwargs.kv_transfer_config: must be a mapping"),
        ({"prefill_timeout_s": 0}, "models[0].disaggregation.prefill_timeout_s"),
        ({"decode": {"deployment_config": {"num_replicas": 0}}},
         "models[0].disaggregation.decode.deployment_config.num_replicas"),
        ({"prefill": {"engine_kwargs": {"max_num_seqs": 0}}},
         "models[0].disaggregation.prefill.engine_kwargs.max_num_seqs"),
    ],
)  # fmt: skip
def test_refusals_name_the_key_path(change: dict[str, Any], path: str) -> None:
    for sleeps in (False, True):  # a sleep_config's checks read the pools too
        data = pd_config()
        if sleeps:
            data["models"][0]["sleep_config"] = {"sleep_after_idle_s": 60}
        section = data["models"][0]["disaggregation"]
        for key, value in copy.deepcopy(change).items():
            section[key] = value
        with pytest.raises(ConfigError) as info:
            load_config(data)
        assert str(info.value).startswith(path), str(info.value)


# ---- the ingress's prefill hop ---------------------------------------------------------------


class ScriptedStream:
    def __init__(self, items: list[Any], delay_s: float = 0.0) -> None:
        self.items, self.delay_s, self.cancelled = items, delay_s, False

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(self.delay_s)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedHandle:
    """A deployment handle whose ``generate`` streams ``stream``, recording what it got."""

    def __init__(self, stream: ScriptedStream) -> None:
        self.stream, self.sent, self.options_seen = stream, [], []
        self.generate = self

    def options(self, **options: Any) -> ScriptedHandle:
        self.options_seen.append(options)
        return self

    def remote(self, payload: GenerateRequest) -> ScriptedStream:
        self.sent.append(payload)
        return self.stream


PAYLOAD = GenerateRequest(
    messages=[{"role": "user", "content": "hi"}], params={"max_tokens": 50, "n": 3,
    "logprobs": 2, "truncate_prompt_tokens": 40}, cache_salt="s", echo=True, channel="sink",
    timeout=9.0,
)  # fmt: skip


def test_the_prefill_request_is_the_prompt_and_one_greedy_token() -> None:
    request = prefill_request(PAYLOAD)
    assert request.params == {"max_tokens": 1, "temperature": 0.0, "truncate_prompt_tokens": 40}
    assert (request.messages, request.cache_salt) == (PAYLOAD.messages, "s")
    assert request.channel is None and not request.echo and request.timeout is None
    assert request.request_id != PAYLOAD.request_id


@pytest.mark.parametrize(
    ("items", "delay_s", "finished"),
    [
        ([StreamStart(prompt_tokens=3)], 0.0, True),
        ([StreamStart(prompt_tokens=3), StreamError(status=400, message="no")], 0.0, False),
        ([ray.exceptions.RayActorError()], 0.0, False),
        ([StreamStart(prompt_tokens=3)], 0.5, False),  # past the 0.1 s timeout
    ],
)
def test_the_prefill_hop_never_fails_the_request(
    items: list[Any], delay_s: float, finished: bool
) -> None:
    stream = ScriptedStream(items, delay_s)
    handle = ScriptedHandle(stream)
    result = asyncio.run(prefill(handle, "alpha", PAYLOAD, 0.1, "m"))
    assert (result is not None) is finished
    assert stream.cancelled  # whatever happened, the prefill request is not left running
    assert {"multiplexed_model_id": "alpha"} in handle.options_seen


def test_the_kv_store_credit_reaches_the_router_only_with_a_node_kv_store() -> None:
    data = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    data["models"][0]["deployment_config"] = {"num_replicas": 2}
    plain = load_config(data).models[0].serve_options()["request_router_config"]
    assert plain["request_router_kwargs"]["kv_store_credit"] == 0.0
    data["models"][0]["engine_kwargs"]["kv_transfer_config"] = {
        "kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}  # fmt: skip
    stored = load_config(data).models[0].serve_options()["request_router_config"]
    assert stored["request_router_kwargs"]["kv_store_credit"] == 0.5


def test_a_model_level_deployment_config_beside_the_pools_is_refused() -> None:
    """Each pool is a Serve deployment with its own deployment_config: the model's would be
    ignored."""
    data = pd_config()
    data["models"][0]["deployment_config"] = {"num_replicas": 3, "max_ongoing_requests": 7}
    with pytest.raises(ConfigError) as info:
        load_config(data)
    message = str(info.value)
    assert message.startswith("models[0].deployment_config: is not used by a disaggregated")
    assert "disaggregation.decode.deployment_config" in message
