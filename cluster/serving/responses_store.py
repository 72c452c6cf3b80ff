"""Where ``/v1/responses`` keeps stored responses (``store: true``, OpenAI's default) for
``previous_response_id``, ``GET`` and ``DELETE``: one store per Serve application that every
ingress replica sees — a named, detached Ray actor (``llm-cluster-responses:<app>`` in the
``llm-cluster`` namespace, no CPU), created by the first replica that needs it.

It holds each response with its conversation (the input items of the whole chain, so a later
turn needs no earlier record), JSON-encoded, in memory: a bounded LRU (``max_responses``,
``max_bytes``) whose entries also expire ``ttl_s`` after they were stored. It is lost with its
actor (a head-node restart, ``ray stop``); ``cluster shutdown`` leaves it for a redeploy, and
``remove_store`` ends it."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

STORE_NAMESPACE = "llm-cluster"


@dataclass(frozen=True)
class StoreLimits:
    max_responses: int = 10_000
    max_bytes: int = 256 << 20
    ttl_s: float = 3600.0


class ResponseStore:
    """The records, in memory: ``id -> (stored_at, JSON bytes)``, least recently used first."""

    def __init__(
        self, limits: StoreLimits = StoreLimits(), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits, self.clock = limits, clock
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0

    def put(self, response_id: str, record: bytes) -> bool:
        """Store a record (evicting the least recently used past the bounds); False when the
        record alone is over ``max_bytes`` and is not kept."""
        self.delete(response_id)
        if len(record) > self.limits.max_bytes:
            return False
        self._records[response_id] = (self.clock(), record)
        self._bytes += len(record)
        while len(self._records) > self.limits.max_responses or self._bytes > self.limits.max_bytes:
            _, (_, evicted) = self._records.popitem(last=False)
            self._bytes -= len(evicted)
        return True

    def get(self, response_id: str) -> bytes | None:
        entry = self._records.get(response_id)
        if entry is None:
            return None
        if self.clock() - entry[0] > self.limits.ttl_s:
            self.delete(response_id)
            return None
        self._records.move_to_end(response_id)
        return entry[1]

    def delete(self, response_id: str) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is not None:
            self._bytes -= len(entry[1])
        return entry is not None

    def stats(self) -> dict[str, int]:
        return {"responses": len(self._records), "bytes": self._bytes}


def store_actor_name(app_name: str) -> str:
    return f"llm-cluster-responses:{app_name}"


class StoreClient:
    """The ingress's view of the store: records as dicts, over the app's actor (created on
    first use) or, without Serve (tests, the fuzzer), a store in this process."""

    def __init__(self, app_name: str | None, limits: StoreLimits = StoreLimits()) -> None:
        self.app_name, self.limits = app_name, limits
        self._local = ResponseStore(limits) if app_name is None else None
        self._actor: Any = None

    def _handle(self) -> Any:
        if self._actor is None:
            options = {"name": store_actor_name(self.app_name or ""),
                       "namespace": STORE_NAMESPACE, "lifetime": "detached",
                       "get_if_exists": True, "num_cpus": 0, "max_restarts": -1}  # fmt: skip
            self._actor = ray.remote(ResponseStore).options(**options).remote(self.limits)
        return self._actor

    async def _call(self, method: str, *args: Any) -> Any:
        if self._local is not None:
            return getattr(self._local, method)(*args)
        try:
            return await getattr(self._handle(), method).remote(*args)
        except ray.exceptions.RayActorError:
            # Killed (``remove_store``) or lost past its restarts: a new, empty one.
            self._actor = None
            return await getattr(self._handle(), method).remote(*args)

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        return await self._call("put", response_id, json.dumps(record).encode())

    async def get(self, response_id: str) -> dict[str, Any] | None:
        raw = await self._call("get", response_id)
        return None if raw is None else json.loads(raw)

    async def delete(self, response_id: str) -> bool:
        return await self._call("delete", response_id)


def remove_store(app_name: str) -> bool:
    """End an application's store actor (its records with it); False if it has none."""
    try:
        actor = ray.get_actor(store_actor_name(app_name), namespace=STORE_NAMESPACE)
    except ValueError:
        return False
    ray.kill(actor)
    return True


__all__ = ["ResponseStore", "StoreClient", "StoreLimits", "remove_store", "store_actor_name"]
