"""The head side of ``SharedStorageConnector``: which blocks of a request to load from the
store when it is admitted, which computed prompt blocks to save, and what a failed load undoes.

    admit (Scheduler._admit_waiting)   device prefix hits, then the blocks stored after them
                                       (``stored_blocks``): allocated like new ones, counted as
                                       computed, and loaded by the workers before the forward
                                       pass (``ExecuteModelRequest.kv_loads``)
    after a step (update_from_output)  the prompt blocks it completed (``completed``) are
                                       saved by the workers at the start of the next step
                                       (``kv_saves``), before anything writes the cache
    a load failed (any rank)           ``ModelRunnerOutput.kv_load_failures``: the request's
                                       work in that step is void; it continues from the first
                                       block not loaded (recomputed), nothing else changes

Only whole prompt blocks are stored (the prefixes a later request shares; LMCache's default);
the last prompt token is always computed, as with device hits. ``NixlConnector``'s head side
(``engine.kv_transfer.nixl``) has the same interface (``engine.kv_transfer.connector``).
"""

from __future__ import annotations

from typing import Any

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.kv_transfer.store import engine_store


class KVTransferScheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        kv = config.kv_transfer.kv_transfer_config
        if kv is None:
            raise ValueError("kv_transfer_config: not set")
        self.config = kv
        self.store = engine_store(config)
        self.block_manager = block_manager
        self.block_size = config.cache.block_size
        self._pending_saves: list[tuple[bytes, int]] = []
        self.queried_tokens = 0  # tokens looked up in the store (after the device hits)
        self.hit_tokens = 0  # of those, loaded from the store
        self.failed_tokens = 0  # loaded tokens voided by a failed load (recomputed)

    def _lookup_range(self, request: Request, num_cached: int) -> range:
        """The request's blocks after its ``num_cached`` device hits that the store may supply
        (the last prompt token is always computed); empty when it may not reuse blocks."""
        if not self.config.loads or not self.block_manager.may_reuse(request):
            return range(0)
        return range(num_cached // self.block_size, (request.num_tokens - 1) // self.block_size)

    def stored_blocks(self, request: Request, num_cached: int) -> int:
        """How many blocks after the request's ``num_cached`` device hits the store holds."""
        blocks = self._lookup_range(request, num_cached)
        if not blocks:
            return 0
        hashes = self.block_manager.block_hashes(request, blocks.stop)
        return self.store.leading_hits(hashes[blocks.start :])

    def admit(self, request: Request, num_cached: int, count: int) -> list[tuple[bytes, int]]:
        """The request was admitted with ``count`` stored blocks after its device hits, its
        blocks allocated: their (hash, block id), for the workers to load. Counts the lookup."""
        blocks = self._lookup_range(request, num_cached)
        self.queried_tokens += len(blocks) * self.block_size
        self.hit_tokens += count * self.block_size
        if not count:
            return []
        first = blocks.start
        hashes = self.block_manager.block_hashes(request, first + count)
        table = self.block_manager.get_block_ids(request.request_id)
        return [(hashes[i], table[i]) for i in range(first, first + count)]

    def completed(self, request: Request, before: int, after: int) -> None:
        """A step took the request from ``before`` to ``after`` computed tokens: queue the
        prompt blocks it completed for saving."""
        if not self.config.saves or not self.block_manager.may_reuse(request):
            return
        bs = self.block_size
        end = min(after, request.num_prompt_tokens) // bs
        if end <= before // bs:
            return
        hashes = self.block_manager.block_hashes(request, end)
        table = self.block_manager.get_block_ids(request.request_id)
        self._pending_saves += [(hashes[i], table[i]) for i in range(before // bs, end)]

    @property
    def has_saves(self) -> bool:
        return bool(self._pending_saves)

    def take_saves(self) -> list[tuple[bytes, int]]:
        saves, self._pending_saves = self._pending_saves, []
        return saves

    def load_source(self, request_id: str) -> dict[str, Any] | None:
        """Where a request's loads come from besides the keys: the store needs nothing."""
        return None

    def hold(self, request: Request) -> bool:
        """A finishing request's blocks are freed at once (the store has copies)."""
        return False

    def holds(self, request_id: str) -> bool:
        return False

    @property
    def num_held(self) -> int:
        """Finished requests whose blocks are held for another engine's read."""
        return 0

    @property
    def has_pending(self) -> bool:
        return False

    def poll(self) -> None:
        """Nothing waits on another engine."""

    def register_workers(self, metadata: list[dict[str, Any]]) -> None:
        """The workers need no introduction: they share the store's directory."""

    def failed(self, request: Request, first: int, loaded: int, requested: int) -> None:
        """A rank loaded only ``loaded`` of the ``requested`` blocks from block ``first``: the
        request continues from there."""
        self.hit_tokens -= (requested - loaded) * self.block_size
        self.failed_tokens += (requested - loaded) * self.block_size
        request.num_computed_tokens = (first + loaded) * self.block_size
        request.num_cached_tokens = min(request.num_cached_tokens, request.num_computed_tokens)
