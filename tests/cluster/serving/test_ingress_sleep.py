"""The sleep-mode admin routes' rules at the ingress, without Serve: ``/sleep`` and
``/wake_up`` exist only behind API keys (403 otherwise, naming ``api_keys``); ``model`` may be
left out only when one model is served; a model's state is the union of its replicas'."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.api.api_errors import APIError
from cluster.serving.ingress import OpenAIIngress


class _Broadcast:
    def __init__(self, replies: list[dict[str, Any]]) -> None:
        self.replies = replies

    async def results_async(self) -> list[dict[str, Any]]:
        return self.replies


class _Handle:
    def __init__(self, replies: list[dict[str, Any]]) -> None:
        self.replies = replies

    def broadcast(self, method: str, *args: Any) -> _Broadcast:
        return _Broadcast(self.replies)


def _ingress(keys: list[str], replies: dict[str, list[dict[str, Any]]]) -> OpenAIIngress:
    ingress = object.__new__(OpenAIIngress)
    ingress.servers = {m: _Handle(r) for m, r in replies.items()}  # type: ignore[misc]
    ingress.api_key_hashes = keys
    ingress.awake = None
    return ingress


def _state(level: int | None) -> dict[str, Any]:
    return {"model": "m", "is_sleeping": level is not None, "sleep_level": level}


def test_without_api_keys_the_admin_routes_are_403_naming_api_keys() -> None:
    ingress = _ingress([], {"m": [_state(None)]})
    for call in (ingress.sleep("m", 1), ingress.wake_up("m", None)):
        with pytest.raises(APIError) as info:
            asyncio.run(call)
        assert info.value.status == 403 and "api_keys" in info.value.message
    assert asyncio.run(ingress.model_sleep_state("m"))["is_sleeping"] is False


def test_a_model_is_asleep_only_when_every_replica_is() -> None:
    ingress = _ingress(["k"], {"m": [_state(1), _state(None)]})
    assert asyncio.run(ingress.model_sleep_state(None)) == {
        "model": "m", "is_sleeping": False, "replicas": 2, "sleep_level": None}  # fmt: skip
    ingress = _ingress(["k"], {"m": [_state(1), _state(2)]})
    assert asyncio.run(ingress.model_sleep_state("m"))["sleep_level"] == 2


def test_a_replica_refusal_is_the_answer() -> None:
    ingress = _ingress(["k"], {"m": [_state(1), {"error": "3 requests in flight", "status": 409}]})
    with pytest.raises(APIError) as info:
        asyncio.run(ingress.sleep_model("m", 1))
    assert info.value.status == 409 and info.value.message == "3 requests in flight"


def test_model_may_be_left_out_only_with_one_model() -> None:
    ingress = _ingress(["k"], {"a": [_state(None)], "b": [_state(None)]})
    with pytest.raises(APIError) as info:
        asyncio.run(ingress.model_sleep_state(None))
    assert info.value.status == 400 and info.value.param == "model"
