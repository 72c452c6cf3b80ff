"""What the engine core reports about itself: the counters ``/metrics`` reads
(``EngineCounters``), the sizes of the scheduler's per-request tables (a leak check for soak
tests and operators) and the scheduler's consistency check. ``LLMEngine`` adds its own tables
to these; a data-parallel engine sums them over its cores.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler


@dataclass(frozen=True)
class EngineCounters:
    """Requests running and waiting now; preemptions and prefix-cache lookups and hits (in
    tokens) since the engine started: the device cache's, and the KV store's
    (``kv_transfer_config``: tokens looked up there after the device's hits, and loaded)."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0


def engine_counters(scheduler: Scheduler, blocks: BlockManager) -> EngineCounters:
    """The scheduler's and prefix caches' numbers for metrics."""
    kv = scheduler.kv_transfer
    return EngineCounters(
        num_running=len(scheduler.running),
        num_waiting=scheduler.num_waiting,
        num_preemptions=scheduler.num_preemptions,
        prefix_cache_queries=blocks.prefix_queries,
        prefix_cache_hits=blocks.prefix_hits,
        external_prefix_cache_queries=kv.queried_tokens if kv is not None else 0,
        external_prefix_cache_hits=kv.hit_tokens if kv is not None else 0,
    )


def scheduler_state_sizes(scheduler: Scheduler) -> dict[str, int]:
    """Entries in each per-request table of the scheduler and its block manager (all 0 once
    idle)."""
    kv = scheduler.kv_transfer
    return {
        "scheduler_requests": len(scheduler.requests),
        "pending_forks": len(scheduler.pending_forks),
        "finished_not_flushed": len(scheduler._finished_req_ids),
        "requests_in_flight": len(scheduler.in_flight),
        "kv_requests_held_for_transfer": kv.num_held if kv is not None else 0,
        **scheduler.block_manager.table_sizes(),
    }


def check_scheduler_integrity(scheduler: Scheduler) -> None:
    """Block manager invariants, plus: every live request is in exactly one queue, and no
    running request has more tokens computed than known."""
    scheduler.block_manager.check_integrity()
    queued = list(scheduler.waiting) + scheduler.running + scheduler.swapped
    queued += [r for forks in scheduler.pending_forks.values() for r in forks]
    if sorted(r.request_id for r in queued) != sorted(scheduler.requests):
        raise RuntimeError("scheduler queues disagree with the set of live requests")
    for request in scheduler.running:
        if request.num_computed_tokens > request.num_tokens:
            raise RuntimeError(f"{request}: more tokens computed than known")
