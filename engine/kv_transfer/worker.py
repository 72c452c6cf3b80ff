"""The worker side of ``SharedStorageConnector``: this worker's shard of a block (its KV heads,
its stage's layers, the draft's too) saved to and loaded from the ``BlockStore``. A block's
shard is the block's bytes of every cache of the worker's KV cache group, one after another,
in layer order."""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.kv_transfer.store import engine_store

logger = logging.getLogger("llm_cluster.kv_transfer")


class WorkerKVTransfer:
    def __init__(self, config: EngineConfig, shard: int) -> None:
        self.store = engine_store(config)
        self.shard = shard
        self._save_error_logged = False

    @staticmethod
    def _block(cache: torch.Tensor, block_id: int) -> torch.Tensor:
        """One block of one layer's cache (``[planes, num_blocks, block_size, heads, dim]``)."""
        return cache[:, block_id]

    def save(self, caches: list[torch.Tensor], saves: list[tuple[bytes, int]]) -> None:
        """Store the shards of these blocks that are not stored yet. A failed write (storage
        full, unwritable) loses nothing: the block stays computable; it is logged once."""
        for block_hash, block_id in saves:
            if self.store.contains(block_hash, self.shard):
                continue
            parts = [self._block(c, block_id).reshape(-1).view(torch.uint8) for c in caches]
            data = torch.cat(parts).cpu().numpy().tobytes()
            try:
                self.store.write(block_hash, self.shard, data)
            except OSError as exc:
                if not self._save_error_logged:
                    logger.warning("kv_transfer_config: cannot store a KV block: %s", exc)
                    self._save_error_logged = True
                return

    def load(
        self, caches: list[torch.Tensor], loads: dict[str, list[tuple[bytes, int]]]
    ) -> dict[str, int]:
        """Copy stored blocks into the cache; returns the requests whose blocks did not all
        load, with how many of them (from the first) did."""
        failures: dict[str, int] = {}
        sizes = [self._block(c, 0).numel() * c.element_size() for c in caches]
        for rid, pairs in loads.items():
            for i, (block_hash, block_id) in enumerate(pairs):
                data = self.store.read(block_hash, self.shard, sum(sizes))
                if data is None:
                    failures[rid] = i
                    break
                raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                offset = 0
                for cache, size in zip(caches, sizes, strict=True):
                    block = self._block(cache, block_id)
                    part = raw[offset : offset + size].view(cache.dtype).view(block.shape)
                    block.copy_(part, non_blocking=False)
                    offset += size
        return failures
