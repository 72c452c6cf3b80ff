"""The block pool of one KV cache group: its physical blocks, their LRU free queue, the prefix
cache that maps a full block's chained hash to the block holding it, the CPU swap blocks, and
the block tables of its requests (``KVCacheGroup``). ``engine.core.block_manager`` acts on every
group at once.

A full block whose tokens are computed gets a chained sha256 hash (``hash_block_tokens``: parent
hash, token ids, cache salt, LoRA adapter) and is registered in the prefix cache; when freed it
stays cached in the LRU free queue and is evicted only when a new block is needed and no
uncached free block is left ahead of it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from engine.core.kv_cache_groups import KVCacheGroupSpec
from engine.core.request import Request


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """LRU order of free blocks with O(1) pop-front, append and removal from the middle.

    Front = evicted first. A prefix-cache hit on a free block removes it from the middle.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._queue

    def popleft(self) -> KVCacheBlock:
        return self._queue.popitem(last=False)[1]

    def remove(self, block: KVCacheBlock) -> None:
        del self._queue[block.block_id]

    def append(self, block: KVCacheBlock) -> None:
        self._queue[block.block_id] = block

    def __iter__(self):
        return iter(self._queue.values())


def hash_block_tokens(
    parent_hash: bytes | None,
    token_ids: list[int],
    salt: str | None,
    lora: str | None = None,
    mm_hashes: tuple[str, ...] = (),
) -> bytes:
    """Chained sha256 of one full block: its tokens, its parent's hash, (first block) a salt
    and the LoRA adapter, so that neither another salt's nor another adapter's requests (whose
    K/V differ) share its blocks; and the content hashes of the images whose placeholder tokens
    fall in the block (vLLM's ``mm_hashes`` extra keys): two images behind the same placeholder
    ids never share a block."""
    h = hashlib.sha256()
    h.update(parent_hash or b"\x00" * 32)
    if parent_hash is None and salt:
        h.update(b"salt:" + salt.encode())
    if parent_hash is None and lora:
        h.update(b"lora:" + lora.encode())
    h.update(array("q", token_ids).tobytes())
    for mm_hash in mm_hashes:
        h.update(b"mm:" + mm_hash.encode())
    return h.digest()


class KVCacheGroup:
    """One group's pool (blocks, LRU free queue, prefix cache, CPU swap blocks) and the block
    tables of its requests. A sliding group's first block is its null block.

    A sliding-window group (window W) frees, when the request is next scheduled with c computed
    tokens, every block wholly before position ``c - W + 1`` (no query from c on can see it) and
    puts its null block in that table entry, so it holds at most
    ``ceil((W - 1 + n) / block_size) + 1`` blocks after a step of n tokens. Its prefix-cache hit
    at P blocks needs only the ``ceil((W - 1) / block_size)`` blocks before P cached (what the
    first query at P reads; vLLM v1's rule), with null blocks before them; a request's hit is
    the longest P that every group can serve (full groups: their longest cached prefix). Swap
    moves a group's held blocks only; its null entries come back as null entries.
    """

    def __init__(
        self,
        spec: KVCacheGroupSpec,
        offset: int,
        num_blocks: int,
        cpu_offset: int,
        num_cpu_blocks: int,
        block_size: int,
    ) -> None:
        if spec.is_sliding and num_blocks < 2:
            raise ValueError(
                f"num_blocks: a sliding-window group needs >= 2 blocks (one is its null block), "
                f"got {num_blocks}"
            )
        self.window = spec.sliding_window
        self.block_size = block_size
        self.blocks = [KVCacheBlock(offset + i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = self.blocks[0] if self.window else None
        self.free_queue = FreeBlockQueue(self.blocks[1:] if self.window else self.blocks)
        self.num_usable = len(self.free_queue)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are hashed and registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Sliding group: how many leading entries of each table are the null block.
        self.num_skipped: dict[str, int] = {}
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks: list[int] = list(
            range(cpu_offset + num_cpu_blocks - 1, cpu_offset - 1, -1)
        )
        self.cpu_offset = cpu_offset
        # Swapped requests: the CPU blocks of their held blocks, and their leading null entries.
        self.req_to_cpu_blocks: dict[str, list[int]] = {}
        self.swapped_skipped: dict[str, int] = {}

    def is_null(self, block: KVCacheBlock) -> bool:
        return block is self.null_block

    # ---- sliding window ------------------------------------------------------------------

    def free_outside_window(self, request: Request) -> None:
        """Free the blocks no query from ``num_computed_tokens`` on can see (sliding groups)."""
        if self.window is None or self.null_block is None:
            return
        table = self.req_to_blocks.get(request.request_id)
        if not table:
            return
        first_seen = max(0, request.num_computed_tokens - self.window + 1) // self.block_size
        end = min(first_seen, len(table))
        start = self.num_skipped.get(request.request_id, 0)
        for i in range(start, end):
            block = table[i]
            if block is not self.null_block:
                self._release_one(block)
                table[i] = self.null_block
        if end > start:
            self.num_skipped[request.request_id] = end

    def window_blocks(self) -> int:
        """Blocks before a prefix-cache hit point that its first uncached query reads."""
        return -(-((self.window or 1) - 1) // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------

    def longest_hit(self, hashes: list[bytes], limit: int) -> int:
        """The largest P <= ``limit`` at which this group can serve a hit of P blocks."""
        if self.window is None:
            for i in range(limit):
                if hashes[i] not in self.cached:
                    return i
            return limit
        needed = self.window_blocks()
        if needed == 0:
            return limit
        run = 0
        for i in range(limit - 1, -1, -1):
            if hashes[i] in self.cached:
                run += 1
                if run == needed:
                    return i + needed
            else:
                run = 0
        return run  # blocks [0, run) are all cached

    def hit_blocks(self, hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock]:
        """The table prefix of a hit of ``num_blocks`` blocks (``longest_hit`` allowed it)."""
        if self.null_block is None:
            return [self.cached[h] for h in hashes[:num_blocks]]
        first = max(0, num_blocks - self.window_blocks())
        return [self.null_block] * first + [self.cached[h] for h in hashes[first:num_blocks]]

    def reset_prefix_cache(self) -> None:
        """Drop every block's hash (the caller checked that no request holds one)."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()

    def cache_blocks(self, request: Request, hashes_of: _HashesOf) -> None:
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = hashes_of(request, num_full)
        for i in range(start, num_full):
            block = blocks[i]
            if block is self.null_block:
                continue
            if block.block_hash is None and hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                self.cached[hashes[i]] = block
        self.num_cached_blocks[request.request_id] = num_full

    # ---- allocation ---------------------------------------------------------------------

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, num_new_computed: int = 0
    ) -> int:
        held = len(self.req_to_blocks.get(request.request_id, ())) + num_new_computed
        total_tokens = (
            request.num_computed_tokens + num_new_computed * self.block_size + num_new_tokens
        )
        return max(0, -(-total_tokens // self.block_size) - held)

    def shared_write_index(self, request: Request, num_new_tokens: int) -> int | None:
        """Index in the table of a shared block the next tokens would be written into."""
        offset = request.num_computed_tokens % self.block_size
        index = request.num_computed_tokens // self.block_size
        table = self.req_to_blocks.get(request.request_id, ())
        if num_new_tokens == 0 or offset == 0 or index >= len(table):
            return None
        return index if table[index].ref_cnt > 1 else None

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed: list[KVCacheBlock]
    ) -> tuple[int, int | None] | None:
        """(blocks to allocate, shared index to copy) if they fit, else None."""
        needed = self.num_blocks_needed(request, num_new_tokens, len(computed))
        # Touching a cached block that sits in the free queue takes it out of the free count.
        revived = sum(1 for b in computed if b.ref_cnt == 0 and b is not self.null_block)
        shared = None if computed else self.shared_write_index(request, num_new_tokens)
        if needed + (shared is not None) > len(self.free_queue) - revived:
            return None
        return needed, shared

    def allocate(
        self,
        request_id: str,
        needed: int,
        shared: int | None,
        computed: list[KVCacheBlock],
        copies: list[tuple[int, int, str]],
    ) -> list[KVCacheBlock]:
        table = self.req_to_blocks.setdefault(request_id, [])
        if shared is not None:
            self._copy_on_write(request_id, table, shared, copies)
        for block in computed:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
        table.extend(computed)
        if computed:
            self.num_cached_blocks[request_id] = len(table)
            skipped = sum(1 for b in computed if b is self.null_block)
            if skipped:
                self.num_skipped[request_id] = skipped
        new_blocks = [self._pop_free_block() for _ in range(needed)]
        table.extend(new_blocks)
        return new_blocks

    def _copy_on_write(
        self,
        request_id: str,
        table: list[KVCacheBlock],
        index: int,
        copies: list[tuple[int, int, str]],
    ) -> None:
        src = table[index]
        dst = self._pop_free_block()
        src.ref_cnt -= 1  # still >= 1: another table holds it
        table[index] = dst
        copies.append((src.block_id, dst.block_id, request_id))

    def fork(self, parent_id: str, child_id: str, num_blocks: int) -> None:
        blocks = self.req_to_blocks[parent_id][:num_blocks]
        if child_id in self.req_to_blocks:
            raise RuntimeError(f"fork: {child_id!r} already holds blocks")
        for block in blocks:
            if block is not self.null_block:
                block.ref_cnt += 1
        self.req_to_blocks[child_id] = list(blocks)
        skipped = min(self.num_skipped.get(parent_id, 0), num_blocks)
        if skipped:
            self.num_skipped[child_id] = skipped

    def _pop_free_block(self) -> KVCacheBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            # Evict: the block's contents are about to be overwritten.
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.num_skipped.pop(request_id, None)
        # Reverse order: a prompt's tail blocks are evicted before its head, so the longest
        # reusable prefix survives longest.
        for block in reversed(blocks):
            if block is not self.null_block:
                self._release_one(block)

    def _release_one(self, block: KVCacheBlock) -> None:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue.append(block)

    # ---- swapping -----------------------------------------------------------------------

    def held_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return [b for b in self.req_to_blocks.get(request_id, ()) if b is not self.null_block]

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        held = self.held_blocks(request_id)
        skipped = len(self.req_to_blocks.get(request_id, ())) - len(held)
        cpu_ids = [self.free_cpu_blocks.pop() for _ in held]
        self.req_to_cpu_blocks[request_id] = cpu_ids
        self.swapped_skipped[request_id] = skipped
        self.free(request_id)
        return [(b.block_id, c) for b, c in zip(held, cpu_ids)]

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        cpu_ids = self.req_to_cpu_blocks.pop(request_id)
        skipped = self.swapped_skipped.pop(request_id)
        blocks = [self._pop_free_block() for _ in cpu_ids]
        nulls = [self.null_block] * skipped if self.null_block is not None else []
        self.req_to_blocks[request_id] = nulls + blocks
        if skipped:
            self.num_skipped[request_id] = skipped
        self.free_cpu_blocks.extend(reversed(cpu_ids))
        return [(c, b.block_id) for c, b in zip(cpu_ids, blocks)]

    def free_swapped(self, request_id: str) -> None:
        cpu_ids = self.req_to_cpu_blocks.pop(request_id, [])
        self.swapped_skipped.pop(request_id, None)
        self.free_cpu_blocks.extend(reversed(cpu_ids))

    # ---- introspection ------------------------------------------------------------------

    def check_integrity(self) -> None:
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        pool = [b for b in self.blocks if b is not self.null_block]
        for block in pool:
            expected = holders.get(block.block_id, 0)
            if block.ref_cnt != expected:
                raise RuntimeError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} != holders {expected}"
                )
            if (block.ref_cnt == 0) != (block in self.free_queue):
                raise RuntimeError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} "
                    f"but in_free_queue={block in self.free_queue}"
                )
        if self.null_block is not None and self.null_block in self.free_queue:
            raise RuntimeError(f"null block {self.null_block.block_id} is in the free queue")
        used = sum(1 for b in pool if b.ref_cnt > 0)
        if used + len(self.free_queue) != self.num_usable:
            raise RuntimeError(
                f"free {len(self.free_queue)} + used {used} != total {self.num_usable}"
            )
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                raise RuntimeError(
                    f"prefix cache entry points at block {block.block_id} with another hash"
                )
        swapped = [c for ids in self.req_to_cpu_blocks.values() for c in ids]
        cpu_ids = swapped + self.free_cpu_blocks
        expected_ids = list(range(self.cpu_offset, self.cpu_offset + self.num_cpu_blocks))
        if sorted(cpu_ids) != expected_ids:
            raise RuntimeError(
                f"cpu blocks: {len(swapped)} swapped + {len(self.free_cpu_blocks)} free "
                f"do not partition {self.num_cpu_blocks}"
            )


class _HashesOf(Protocol):
    def __call__(self, request: Request, num_full_blocks: int) -> list[bytes]: ...
