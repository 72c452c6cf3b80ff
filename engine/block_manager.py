"""PagedAttention block manager: physical KV blocks, block tables, ref counts, prefix caching.

    request block table (logical order)      physical pool (num_blocks blocks of block_size slots)
    req A: [7, 2, 9]                         ┌───┬───┬───┬───┬───┬───┬───┬───┬───┬───┐
    req B: [7, 4]      (block 7 shared)      │ 0 │ 1 │ 2 │ 3 │ 4 │ 5 │ 6 │ 7 │ 8 │ 9 │
                                             └───┴───┴───┴───┴───┴───┴───┴───┴───┴───┘
    slot of token t = block_table[t // block_size] * block_size + t % block_size

Copy-on-write: several block tables may hold one block (prefix-cache hits, and the prompt
blocks a parallel sample shares with its siblings after ``fork``). Prefix-cache hits are full
blocks that are never written again; the only shared block a request writes into is the one
holding a forked group's last prompt token (each forked sample recomputes that token, and the
first sample appends after it). A request about to write into a block whose ref count is above 1
gets a fresh block instead, and the (src, dst) pair is queued in ``pending_copies`` for the
workers to copy before the forward pass. The last holder writes in place, so a group of n
samples makes at most n - 1 copies.

Invariants (``check_integrity``): a block is in the free queue iff its ref count is 0; its ref
count equals the number of block tables holding it; free + used = total. A full block whose
tokens are computed gets a chained sha256 hash (parent hash, token ids, cache salt, LoRA
adapter) and is registered in the prefix cache; when freed it stays cached in the LRU free
queue and is evicted only when a new block is needed and no uncached free block is left ahead
of it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.request import Request


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
    parent_hash: bytes | None, token_ids: list[int], salt: str | None, lora: str | None = None
) -> bytes:
    """Chained sha256 of one full block: its tokens, its parent's hash, and (first block) a salt
    and the LoRA adapter, so that neither another salt's nor another adapter's requests (whose
    K/V differ) share its blocks."""
    h = hashlib.sha256()
    h.update(parent_hash or b"\x00" * 32)
    if parent_hash is None and salt:
        h.update(b"salt:" + salt.encode())
    if parent_hash is None and lora:
        h.update(b"lora:" + lora.encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(frozen=True)
class KVCacheStats:
    total: int
    free: int  # free blocks, cached ones included (they are evictable)
    cached: int  # free blocks that still hold a reusable prefix
    used: int
    cpu_total: int
    cpu_free: int

    @property
    def usage(self) -> float:
        return self.used / self.total if self.total else 0.0


class BlockManager:
    """Allocates device blocks (and CPU swap blocks) to requests; O(1) per block."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are hashed and registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.req_to_cpu_blocks: dict[str, list[int]] = {}
        # (src, dst, request_id) copy-on-write pairs not yet handed to a step.
        self.pending_copies: list[tuple[int, int, str]] = []
        self.prefix_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.prefix_hits = 0  # of those, found cached

    # ---- prefix cache -------------------------------------------------------------------

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """The request's chained block hashes for its first ``num_full_blocks`` blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = request.all_token_ids[i * bs : (i + 1) * bs]
            lora = request.lora_request.prefix_key if request.lora_request is not None else None
            hashes.append(hash_block_tokens(parent, tokens, request.cache_salt, lora))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a request about to be scheduled: (blocks, num tokens).

        At least one token is always left to compute, since the step must produce logits. A
        request that wants prompt logprobs, or one that says ``skip_prefix_cache`` (mean
        pooling), gets no hits: every prompt position must be computed.
        """
        if (
            not self.enable_prefix_caching
            or request.skip_prefix_cache
            or request.sampling_params.prompt_logprobs is not None
        ):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in self._block_hashes(request, max_blocks):
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            block = blocks[i]
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

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's block table to hold ``num_new_tokens`` more tokens.

        ``new_computed_blocks`` (prefix-cache hits, first schedule only) are prepended first.
        Returns the newly allocated blocks, or None (and changes nothing) if they do not fit.
        """
        new_computed_blocks = new_computed_blocks or []
        needed = self.num_blocks_needed(request, num_new_tokens, len(new_computed_blocks))
        # Touching a cached block that sits in the free queue takes it out of the free count.
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        shared = None if new_computed_blocks else self._shared_write_index(request, num_new_tokens)
        if needed + (shared is not None) > len(self.free_queue) - revived:
            return None
        table = self.req_to_blocks.setdefault(request.request_id, [])
        if shared is not None:
            self._copy_on_write(request.request_id, table, shared)
        for block in new_computed_blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
        table.extend(new_computed_blocks)
        if new_computed_blocks:
            self.num_cached_blocks[request.request_id] = len(table)
        new_blocks = [self._pop_free_block() for _ in range(needed)]
        table.extend(new_blocks)
        return new_blocks

    def _shared_write_index(self, request: Request, num_new_tokens: int) -> int | None:
        """Index in the table of a shared block the next tokens would be written into."""
        offset = request.num_computed_tokens % self.block_size
        index = request.num_computed_tokens // self.block_size
        table = self.req_to_blocks.get(request.request_id, ())
        if num_new_tokens == 0 or offset == 0 or index >= len(table):
            return None
        return index if table[index].ref_cnt > 1 else None

    def _copy_on_write(self, request_id: str, table: list[KVCacheBlock], index: int) -> None:
        src = table[index]
        dst = self._pop_free_block()
        src.ref_cnt -= 1  # still >= 1: another table holds it
        table[index] = dst
        self.pending_copies.append((src.block_id, dst.block_id, request_id))

    def take_copies(self) -> list[tuple[int, int, str]]:
        """The copy-on-write pairs queued since the last call, for this step's workers."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Give ``child`` the parent's blocks that hold tokens ``[0, num_tokens)``: shared, one
        more reference each; a partially filled last one is copied when the child writes."""
        num_blocks = -(-num_tokens // self.block_size)
        blocks = self.req_to_blocks[parent.request_id][:num_blocks]
        if child.request_id in self.req_to_blocks:
            raise RuntimeError(f"fork: {child.request_id!r} already holds blocks")
        for block in blocks:
            block.ref_cnt += 1
        self.req_to_blocks[child.request_id] = list(blocks)

    def _pop_free_block(self) -> KVCacheBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            # Evict: the block's contents are about to be overwritten.
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def free(self, request: Request) -> None:
        """Release the request's device blocks (cached ones stay cached, evictable)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self._release(blocks)

    def _release(self, blocks: list[KVCacheBlock]) -> None:
        # Reverse order: a prompt's tail blocks are evicted before its head, so the longest
        # reusable prefix survives longest.
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # ---- swapping -----------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        return len(self.req_to_blocks.get(request.request_id, ())) <= len(self.free_cpu_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to CPU swap space; returns (device block, cpu block) pairs."""
        blocks = self.req_to_blocks.pop(request.request_id)
        self.num_cached_blocks.pop(request.request_id, None)
        cpu_ids = [self.free_cpu_blocks.pop() for _ in blocks]
        self.req_to_cpu_blocks[request.request_id] = cpu_ids
        mapping = [(b.block_id, c) for b, c in zip(blocks, cpu_ids)]
        self._release(blocks)
        return mapping

    def can_swap_in(self, request: Request) -> bool:
        return len(self.req_to_cpu_blocks.get(request.request_id, ())) <= len(self.free_queue)

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request back; returns (cpu block, device block) pairs."""
        cpu_ids = self.req_to_cpu_blocks.pop(request.request_id)
        blocks = [self._pop_free_block() for _ in cpu_ids]
        self.req_to_blocks[request.request_id] = blocks
        self.free_cpu_blocks.extend(reversed(cpu_ids))
        return [(c, b.block_id) for c, b in zip(cpu_ids, blocks)]

    def free_swapped(self, request: Request) -> None:
        cpu_ids = self.req_to_cpu_blocks.pop(request.request_id, [])
        self.free_cpu_blocks.extend(reversed(cpu_ids))

    # ---- introspection ------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def stats(self) -> KVCacheStats:
        cached_free = sum(1 for b in self.free_queue if b.block_hash is not None)
        return KVCacheStats(
            total=self.num_blocks,
            free=len(self.free_queue),
            cached=cached_free,
            used=self.num_blocks - len(self.free_queue),
            cpu_total=self.num_cpu_blocks,
            cpu_free=len(self.free_cpu_blocks),
        )

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` describing the first broken invariant, if any."""
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.blocks:
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
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        if used + len(self.free_queue) != self.num_blocks:
            raise RuntimeError(
                f"free {len(self.free_queue)} + used {used} != total {self.num_blocks}"
            )
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                raise RuntimeError(
                    f"prefix cache entry points at block {block.block_id} with another hash"
                )
        swapped = [c for ids in self.req_to_cpu_blocks.values() for c in ids]
        cpu_ids = swapped + self.free_cpu_blocks
        if sorted(cpu_ids) != list(range(self.num_cpu_blocks)):
            raise RuntimeError(
                f"cpu blocks: {len(swapped)} swapped + {len(self.free_cpu_blocks)} free "
                f"do not partition {self.num_cpu_blocks}"
            )
