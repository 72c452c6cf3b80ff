"""The worker side of ``SharedStorageConnector``: the shards of a block this worker holds (its
stage, its KV heads: ``engine.kv_transfer.store``) saved to and loaded from the ``BlockStore``.
A shard's bytes are one KV head's slice of the block in every cache of its family (the
model's layers, or the draft's), one after another in layer order; so a worker of any TP size
reads the heads it holds from files that workers of another TP size wrote."""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.config import EngineConfig
from engine.kv_transfer.store import engine_store, kv_families, shard_name

logger = logging.getLogger("llm_cluster.kv_transfer")

# (cache index in the worker's cache list, local head index) of each part of a shard.
_Slots = list[tuple[int, int]]


def global_kv_heads(total: int, local: int, tp_rank: int, tp_size: int) -> list[int]:
    """The whole model's KV heads that a rank's ``local`` heads are (TP splits the heads, or
    replicates each on ``tp_size / total`` ranks when there are fewer heads than ranks)."""
    if tp_size >= total:
        if local != 1:
            raise ValueError(f"{local} local KV heads with {total} heads over {tp_size} ranks")
        return [tp_rank // (tp_size // total)]
    if local * tp_size != total:
        raise ValueError(f"{local} local KV heads x {tp_size} ranks is not {total} heads")
    return [tp_rank * local + j for j in range(local)]


class WorkerKVTransfer:
    """``num_model_caches``: how many of the caches this worker passes are the model's (the
    rest are its draft's)."""

    def __init__(
        self, config: EngineConfig, stage: int, tp_rank: int, tp_size: int, num_model_caches: int
    ) -> None:
        self.store = engine_store(config)
        self.stage, self.tp_rank, self.tp_size = stage, tp_rank, tp_size
        self.num_model_caches = num_model_caches
        self.totals = dict(kv_families(config))
        self._shards: dict[str, _Slots] | None = None
        self._save_error_logged = False

    def _shard_slots(self, caches: list[torch.Tensor]) -> dict[str, _Slots]:
        """Shard name -> where its parts sit in this worker's caches (computed once)."""
        if self._shards is None:
            shards: dict[str, _Slots] = {}
            for index, cache in enumerate(caches):
                family = "t" if index < self.num_model_caches else "d"
                local = cache.shape[3]  # [planes, blocks, block_size, kv heads, dim]
                heads = global_kv_heads(self.totals[family], local, self.tp_rank, self.tp_size)
                for j, head in enumerate(heads):
                    name = shard_name(self.stage, family, head)
                    shards.setdefault(name, []).append((index, j))
            self._shards = shards
        return self._shards

    @staticmethod
    def _part(cache: torch.Tensor, block_id: int, head: int) -> torch.Tensor:
        """One head of one block of one layer's cache: ``[planes, block_size, dim]``."""
        return cache[:, block_id, :, head]

    def save(self, caches: list[torch.Tensor], saves: list[tuple[bytes, int]]) -> None:
        """Store the shards of these blocks that are not stored yet. A failed write (storage
        full, unwritable) loses nothing: the block stays computable; it is logged once."""
        shards = self._shard_slots(caches)
        for block_hash, block_id in saves:
            for name, slots in shards.items():
                if self.store.contains(block_hash, name):
                    continue
                parts = [
                    self._part(caches[i], block_id, j).contiguous().reshape(-1).view(torch.uint8)
                    for i, j in slots
                ]
                data = torch.cat(parts).cpu().numpy().tobytes()
                try:
                    self.store.write(block_hash, name, data)
                except OSError as exc:
                    if not self._save_error_logged:
                        logger.warning("kv_transfer_config: cannot store a KV block: %s", exc)
                        self._save_error_logged = True
                    return

    def register(self, caches: list[torch.Tensor]) -> None:
        """Nothing to register: blocks go through files."""

    def metadata(self) -> dict[str, Any] | None:
        """Nothing to introduce: every engine of the node shares the store's directory."""
        return None

    def load(
        self,
        caches: list[torch.Tensor],
        loads: dict[str, list[tuple[Any, int]]],
        sources: dict[str, dict[str, Any]] | None = None,
    ) -> dict[str, int]:
        """Copy stored blocks into the cache; returns the requests whose blocks did not all
        load, with how many of them (from the first) did. (``sources``: the store needs
        none; ``NixlWorkerTransfer.load``'s signature.)"""
        failures: dict[str, int] = {}
        shards = self._shard_slots(caches)
        sizes = {
            name: [self._part(caches[i], 0, j).numel() * caches[i].element_size() for i, j in slots]
            for name, slots in shards.items()
        }
        for rid, pairs in loads.items():
            for n, (block_hash, block_id) in enumerate(pairs):
                if not self._load_block(caches, shards, sizes, block_hash, block_id):
                    failures[rid] = n
                    break
        return failures

    def _load_block(
        self,
        caches: list[torch.Tensor],
        shards: dict[str, _Slots],
        sizes: dict[str, list[int]],
        block_hash: bytes,
        block_id: int,
    ) -> bool:
        for name, slots in shards.items():
            data = self.store.read(block_hash, name, sum(sizes[name]))
            if data is None:
                return False
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            offset = 0
            for (i, j), size in zip(slots, sizes[name], strict=True):
                part = self._part(caches[i], block_id, j)
                chunk = raw[offset : offset + size].view(caches[i].dtype).view(part.shape)
                part.copy_(chunk, non_blocking=False)
                offset += size
        return True
