"""The shared storage of ``SharedStorageConnector``: full KV blocks as files, one per (block
hash, shard), in a directory of its own per model and layout, bounded in bytes.

    <shared_storage_path>/<namespace>/<block hash hex>.<stage>.<t|d><kv head>

- **Keys**: a block's chained sha256 (``engine.core.block_manager.hash_block_tokens``: its
  tokens, every token before it, the cache salt and the LoRA adapter), so a file holds exactly
  the K/V that block would compute. The namespace (``store_namespace``) hashes what else the
  bytes depend on: the checkpoint (config, weight files' names, sizes and times), dtype, KV
  cache dtype, block size, the parallel layout and the kernels. A changed checkpoint or layout
  gets another directory: a stale block is never read.
- **Shards**: one file per pipeline stage and KV head (``t`` the model's heads, ``d`` a draft
  model's): that head's K and V (or latent) of every layer of the stage. A worker writes and
  reads the heads it holds, whatever the TP size that wrote them, so engines of different TP
  sizes share blocks (a prefill pool at TP 2 feeds a decode pool at TP 1); a head replicated
  on several ranks (TP above the KV heads, a latent cache) is written once. A block counts as
  stored when every shard's file is (``kv_shards``).
- **Writes** go to a temporary name and are renamed into place, so a reader sees a whole file
  or none. Every process of the node (the replicas' workers and heads) shares the directory.
- **Bound**: beyond ``max_storage_bytes`` the least recently used files go (a lookup refreshes
  a block's files); a writer evicts, after a scan of the directory, when its own writes since
  the last scan could have passed the bound, and adds what it removed to the directory's
  ``.evictions`` count (under a file lock), which ``usage`` reports with the bytes stored.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EVICT_TO = 0.9  # an eviction leaves the store at this share of its bound


def store_namespace(config: Any) -> str:
    """The directory name of this engine's blocks: a hash of everything the bytes of a block
    depend on besides its tokens (see the module docstring). ``config``: an ``EngineConfig``."""
    model = config.model
    files = []
    root = Path(model.model_path)
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if path.suffix in (".safetensors", ".bin", ".pt"):
                stat = path.stat()
                files.append((path.name, stat.st_size, stat.st_mtime_ns))
    draft = config.draft_model
    parallel, cache = config.parallel, config.cache
    identity = {
        "model": os.path.realpath(model.model_path),
        "hf_config": model.hf_config,
        "files": files,
        "dtype": str(model.torch_dtype),
        "quantization": model.quantization,
        "draft": None if draft is None else [os.path.realpath(draft.model_path), draft.dtype],
        "block_size": cache.block_size,
        "kv_cache_dtype": cache.cache_dtype,
        "pp": parallel.pipeline_parallel_size,
        "pp_layer_partition": parallel.pp_layer_partition,
        "ep": parallel.enable_expert_parallel,
        "dp": parallel.data_parallel_size,
        "device": config.device.device,
        "kernels": config.kernel.attention_backend,
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def kv_head_count(hf: dict[str, Any]) -> int:
    """KV heads of a model's cache, whole model: one for a latent (MLA) cache."""
    if hf.get("kv_lora_rank") is not None:  # DeepSeek-V2/V3's latent attention
        return 1
    return int(hf.get("num_key_value_heads") or hf["num_attention_heads"])


def kv_families(config: Any) -> list[tuple[str, int]]:
    """(family, KV heads) of an engine's caches: ``t`` the model's, ``d`` its draft's."""
    families = [("t", kv_head_count(config.model.hf_config))]
    if config.draft_model is not None:
        families.append(("d", kv_head_count(config.draft_model.hf_config)))
    return families


def shard_name(stage: int, family: str, head: int) -> str:
    return f"{stage}.{family}{head}"


def kv_shards(config: Any) -> list[str]:
    """Every shard a stored block has: each pipeline stage's files of each KV head."""
    return [
        shard_name(stage, family, head)
        for stage in range(config.parallel.pipeline_parallel_size)
        for family, heads in kv_families(config)
        for head in range(heads)
    ]


def engine_store(config: Any) -> BlockStore:
    """The store an engine (``config``: its ``EngineConfig``, with ``kv_transfer_config``)
    reads and writes."""
    kv = config.kv_transfer.kv_transfer_config
    if kv is None:
        raise ValueError("kv_transfer_config: not set")
    return BlockStore(
        kv.shared_storage_path, config.kv_transfer.namespace, kv_shards(config),
        kv.max_storage_bytes,
    )  # fmt: skip


class BlockStore:
    """One engine's view of the shared storage (module docstring): a file per block and shard
    (``shards``: the names a stored block has all of) under ``root/namespace``."""

    def __init__(
        self, root: str, namespace: str, shards: Sequence[str | int], max_bytes: int
    ) -> None:
        self.directory = Path(root) / namespace
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shards = list(shards)
        self.max_bytes = max_bytes
        self._written_since_scan = 0
        self.evicted_files = 0

    def path(self, block_hash: bytes, shard: str | int) -> Path:
        return self.directory / f"{block_hash.hex()}.{shard}"

    def leading_hits(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, are stored with every shard. Their files'
        times are refreshed, so an eviction spares them (least recently used first)."""
        for i, block_hash in enumerate(hashes):
            paths = [self.path(block_hash, s) for s in self.shards]
            try:
                for path in paths:
                    os.utime(path)
            except OSError:  # absent (or going): the hit ends here
                return i
        return len(hashes)

    def contains(self, block_hash: bytes, shard: str | int) -> bool:
        return self.path(block_hash, shard).exists()

    def read(self, block_hash: bytes, shard: str | int, nbytes: int) -> bytes | None:
        """The shard's bytes of a block, or None when the file is absent or not ``nbytes`` long
        (evicted, or written by something else): the caller recomputes the block."""
        try:
            data = self.path(block_hash, shard).read_bytes()
        except OSError:
            return None
        return data if len(data) == nbytes else None

    def write(self, block_hash: bytes, shard: str | int, data: bytes) -> None:
        """Store a shard of a block (whole or not at all), then keep the store in its bound."""
        path = self.path(block_hash, shard)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            temporary.write_bytes(data)
            os.replace(temporary, path)
        except OSError:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        self._written_since_scan += len(data)
        if self._written_since_scan > self.max_bytes * (1 - EVICT_TO):
            self.evict()

    def evict(self) -> None:
        """Bring the store under ``EVICT_TO`` of its bound, least recently used files first."""
        self._written_since_scan = 0
        entries = []
        total = 0
        with os.scandir(self.directory) as scan:
            for entry in scan:
                if entry.name.startswith("."):
                    continue
                with contextlib.suppress(OSError):
                    stat = entry.stat()
                    entries.append((stat.st_mtime_ns, stat.st_size, entry.path))
                    total += stat.st_size
        if total <= self.max_bytes:
            return
        entries.sort()
        evicted = 0
        for _, size, path in entries:
            if total <= self.max_bytes * EVICT_TO:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
                total -= size
                evicted += 1
        self.evicted_files += evicted
        if evicted:
            self._count_evictions(evicted)

    def _count_evictions(self, n: int) -> None:
        with open(self.directory / ".evictions", "a+") as counter:
            fcntl.flock(counter, fcntl.LOCK_EX)
            counter.seek(0)
            before = int(counter.read() or 0)
            counter.seek(0)
            counter.truncate()
            counter.write(str(before + n))

    def usage(self) -> tuple[int, int, int]:
        """(bytes stored, files stored, files evicted since the store began) over every
        writer of the node: a scan of the directory (seconds for a very large store)."""
        total = files = 0
        with os.scandir(self.directory) as scan:
            for entry in scan:
                if not entry.name.startswith("."):
                    with contextlib.suppress(OSError):
                        total += entry.stat().st_size
                        files += 1
        try:
            evicted = int((self.directory / ".evictions").read_text() or 0)
        except (OSError, ValueError):
            evicted = 0
        return total, files, evicted
