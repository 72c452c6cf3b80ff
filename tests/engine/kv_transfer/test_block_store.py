"""``BlockStore``: whole files or none, every shard needed for a hit, the size bound kept by
evicting the least recently used files, a lookup refreshing what it finds."""

from __future__ import annotations

import os
import time
from pathlib import Path

from engine.kv_transfer.store import BlockStore

MIB = 1 << 20


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_a_hit_needs_every_shard_and_reads_check_the_size(tmp_path: Path) -> None:
    store = BlockStore(str(tmp_path), "ns", shards=[0, 1], max_bytes=64 * MIB)
    for i in range(3):
        store.write(_hash(i), 0, b"a" * 10)
    store.write(_hash(0), 1, b"b" * 10)
    store.write(_hash(1), 1, b"b" * 10)
    assert store.leading_hits([_hash(0), _hash(1), _hash(2)]) == 2  # block 2 lacks shard 1
    assert store.leading_hits([_hash(2), _hash(0)]) == 0
    assert store.read(_hash(0), 1, 10) == b"b" * 10
    assert store.read(_hash(0), 1, 11) is None  # not the size this engine's block has
    assert store.read(_hash(5), 0, 10) is None
    assert not [p for p in store.directory.iterdir() if p.name.startswith(".")]  # no temporaries


def test_the_bound_evicts_the_least_recently_used_and_a_lookup_refreshes(tmp_path: Path) -> None:
    store = BlockStore(str(tmp_path), "ns", shards=[0], max_bytes=MIB)
    block = 100 * 1024  # ten fit in the bound
    for i in range(8):
        store.write(_hash(i), 0, bytes(block))
        past = time.time() - 1000 + i  # oldest first
        os.utime(store.path(_hash(i), 0), (past, past))
    assert store.leading_hits([_hash(0)]) == 1  # block 0 is now the most recently used
    for i in range(8, 14):
        store.write(_hash(i), 0, bytes(block))
    store.evict()
    used, files, evicted = store.usage()
    assert used <= MIB and used == files * block
    assert store.contains(_hash(0), 0), "the block just looked up was evicted"
    assert not store.contains(_hash(1), 0) and store.contains(_hash(13), 0)
    assert store.evicted_files >= 4
    # The node's count: every writer's evictions (another process's store object here).
    other = BlockStore(store.directory.parent, store.directory.name, [0], store.max_bytes)
    for i in range(14, 20):
        other.write(_hash(i), 0, bytes(block))
    other.evict()
    assert (
        other.usage()[2]
        == store.evicted_files + other.evicted_files
        == evicted + (other.evicted_files)
    )


def test_namespaces_keep_engines_of_other_layouts_apart(tmp_path: Path) -> None:
    one = BlockStore(str(tmp_path), "a", shards=[0], max_bytes=MIB)
    two = BlockStore(str(tmp_path), "b", shards=[0, 1], max_bytes=MIB)
    one.write(_hash(0), 0, b"x")
    assert two.leading_hits([_hash(0)]) == 0


def test_the_namespace_changes_with_what_a_blocks_bytes_depend_on() -> None:
    from engine.config import EngineConfig
    from engine.kv_transfer.store import store_namespace

    def namespace(**kwargs: object) -> str:
        config = EngineConfig.from_kwargs(
            **{"model": "builtin:tiny-llama", "dtype": "float32", **kwargs}
        )
        return store_namespace(config)

    base = namespace()
    assert namespace() == base
    others = [
        namespace(dtype="bfloat16"),
        namespace(block_size=32),
        namespace(kv_cache_dtype="fp8"),
        namespace(pipeline_parallel_size=2),
    ]
    assert base not in others and len(set(others)) == len(others)
    # A shard is one KV head's, whatever TP size wrote it: TP sizes share a namespace.
    assert namespace(tensor_parallel_size=2) == base
