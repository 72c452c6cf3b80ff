"""The stats half of ``LLMServer`` (mixed into it): the engine's queue, KV and prefix-cache
numbers for the ``stats`` handle call, Serve's request router and autoscaling policy (the last
snapshot when fresh, so neither costs a round trip), ``/metrics`` (published once a second,
with the node's KV store measured every ``_STORE_SCAN_S``), and the per-request state the
tests read once a replica is idle. A replica started asleep has no engine and reports zeros.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from engine.client.async_llm_engine import EngineStats
from engine.errors import EngineDeadError
from engine.kv_transfer.store import engine_store

_STORE_SCAN_S = 15.0  # how often the node's KV store is measured for /metrics


class StatsServer:
    """Stats over ``LLMServer``'s engine."""

    engine: Any  # None until a replica started asleep first wakes
    model_id: str
    replica_id: str
    config: Any
    metrics: Any
    sleep_level: int | None

    def _init_stats(self) -> None:
        self._stats_task: asyncio.Task[None] | None = None
        self._last_stats: tuple[float, EngineStats] | None = None  # (monotonic time, snapshot)

    async def stats(self) -> dict[str, Any]:
        stats = await self._engine_stats()
        return {
            "model_id": self.model_id,
            "replica_id": self.replica_id,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_total_blocks": stats.kv_total_blocks,
            "kv_free_blocks": stats.kv_free_blocks,
            "kv_usage": stats.kv_usage,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "external_prefix_cache_queries": stats.external_prefix_cache_queries,
            "external_prefix_cache_hits": stats.external_prefix_cache_hits,
            "num_preemptions": stats.num_preemptions,
            "prompt_tokens_total": stats.prompt_tokens_total,
            "generation_tokens_total": stats.generation_tokens_total,
        }

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's hook for the request router (every ``routing_stats_period_s``): the engine's
        queue and KV usage, from the last snapshot when it is fresh (no extra round trip)."""
        stats = await self._recent_stats()
        return {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_usage": stats.kv_usage,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "sleeping": self.sleep_level is not None,
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook for the autoscaling policy (``cluster.serving.autoscaling_policy``): numbers
        only, aggregated by Serve's controller over ``look_back_period_s``."""
        stats = await self._recent_stats()
        return {
            "num_running": float(stats.num_running),
            "num_waiting": float(stats.num_waiting),
            "kv_usage": float(stats.kv_usage),
            "asleep": float(self.sleep_level is not None),
        }

    async def _recent_stats(self, max_age_s: float = 1.5) -> EngineStats:
        now = time.monotonic()
        if self._last_stats is not None and now - self._last_stats[0] <= max_age_s:
            return self._last_stats[1]
        stats = await self._engine_stats()
        self._last_stats = (now, stats)
        return stats

    async def _engine_stats(self) -> EngineStats:
        if self.engine is None:  # started asleep, not woken yet: it holds nothing
            return EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0)
        return await self.engine.get_stats()

    async def request_state(self) -> dict[str, Any]:
        """Per-request state on the head and the workers (all 0 once idle), plus the KV pool."""
        stats = await self._engine_stats()
        # (Started asleep and not woken yet: nothing held anywhere.)
        state = await self.engine.request_state() if self.engine else {"head": {}, "workers": []}
        return {
            **state,
            "replica_id": self.replica_id,
            "kv_total_blocks": stats.kv_total_blocks,
            "kv_free_blocks": stats.kv_free_blocks,
        }

    async def _publish_stats(self) -> None:
        transfer = self.config.kv_transfer.kv_transfer_config
        store = None  # the node's KV store (SharedStorageConnector): its size, scanned seldom
        if transfer is not None and transfer.kv_connector == "SharedStorageConnector":
            store = engine_store(self.config)
        next_scan = 0.0
        while self.engine is None or not self.engine.is_dead:
            with contextlib.suppress(EngineDeadError):
                stats = await self._engine_stats()
                self._last_stats = (time.monotonic(), stats)
                self.metrics.publish(stats)
            if store is not None and time.monotonic() >= next_scan:
                next_scan = time.monotonic() + _STORE_SCAN_S
                used, files, evicted = await asyncio.to_thread(store.usage)
                self.metrics.publish_kv_store(used, files, evicted, store.max_bytes)
            await asyncio.sleep(1.0)
