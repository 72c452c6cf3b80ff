"""``GET /v1/models`` on the ingress (``OpenAIIngress.models``, no Ray): a model that takes LoRA
adapters lists them, asked of its server, only while Serve runs a replica of it; at zero replicas
(or while its replicas load) it lists the base model alone, since asking would start a replica."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.serving import ingress
from cluster.serving.ingress import OpenAIIngress
from tests.cluster.serving.routed_ingress import Method, RoutedIngress


class _Handle:
    def __init__(self, calls: list[Any]) -> None:
        self.list_adapters = Method(lambda: ["a1"], calls)


class _Ingress(RoutedIngress):
    models = OpenAIIngress.models
    _adapters = OpenAIIngress._adapters


@pytest.mark.parametrize(
    ("states", "listed"),
    [
        ({"m": {"RUNNING": 1}}, ["m", "m:a1"]),
        ({"m": {}}, ["m"]),  # scaled to zero
        ({"m": {"STARTING": 1}}, ["m"]),
        (None, ["m", "m:a1"]),  # Serve's status unreachable: ask the server
    ],
)
def test_adapters_are_listed_only_from_a_running_replica(
    monkeypatch: pytest.MonkeyPatch, states: Any, listed: list[str]
) -> None:
    monkeypatch.setattr(ingress, "replica_states", lambda models: states)
    front = _Ingress(_Handle)
    answer = asyncio.run(front.models())
    assert [card["id"] for card in answer["data"]] == listed
    assert len(front.calls) == (1 if "m:a1" in listed else 0)
