"""PagedAttention block manager: physical KV blocks, block tables, ref counts, prefix caching.

    request block table (logical order)      physical pool (num_blocks blocks of block_size slots)
    req A: [7, 2, 9]                         ┌───┬───┬───┬───┬───┬───┬───┬───┬───┬───┐
    req B: [7, 4]      (block 7 shared)      │ 0 │ 1 │ 2 │ 3 │ 4 │ 5 │ 6 │ 7 │ 8 │ 9 │
                                             └───┴───┴───┴───┴───┴───┴───┴───┴───┴───┘
    slot of token t = block_table[t // block_size] * block_size + t % block_size

Invariants (``check_integrity``): a block is in the free queue iff its ref count is 0; its ref
count equals the number of block tables holding it; free + used = total. A full block whose
tokens are computed gets a chained sha256 hash (parent hash, token ids, cache salt, LoRA
adapter) and is registered in the prefix cache; when freed it stays cached in the LRU free
queue and is evicted only when a new block is needed and no uncached free block is left ahead
of it. Shared blocks are copy-on-write (``BlockManager``). Each KV cache group
(``engine.core.kv_cache_groups``) is a ``KVCacheGroup`` with its own pool and block table per
request over global block ids; ``BlockManager`` acts on every group at once and
``get_block_ids`` lists a request's groups one after the other. docs/kv_cache_groups.md has
the sliding-window rules (freeing, prefix hits, swap, ``stats().usage``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from engine.core.kv_cache_groups import KVCacheGroupSpec, KVCacheLayout
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
    # Each group's used / total, in group order (one entry for a one-group model).
    group_usage: tuple[float, ...] = ()

    @property
    def usage(self) -> float:
        """The fullest group's share of used blocks (used / total with one group)."""
        if self.group_usage:
            return max(self.group_usage)
        return self.used / self.total if self.total else 0.0


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


class BlockManager:
    """Allocates device blocks (and CPU swap blocks) to requests, in every KV cache group;
    O(1) per block.

    Copy-on-write: several block tables may hold one block (prefix-cache hits, and the prompt
    blocks a parallel sample shares with its siblings after ``fork``). Prefix-cache hits are
    full blocks that are never written again; the only shared block a request writes into is
    the one holding a forked group's last prompt token (each forked sample recomputes that
    token, and the first sample appends after it). A request about to write into a block whose
    ref count is above 1 gets a fresh block instead, and the (src, dst) pair is queued in
    ``pending_copies`` for the workers to copy before the forward pass. The last holder writes
    in place, so a group of n samples makes at most n - 1 copies.

    KV cache groups: the methods act on every group at once, and ``get_block_ids`` lists a
    request's groups one after the other (the workers split them by id range). All of a
    request's tables have the same length (one entry per logical block). ``stats().usage`` is
    the fullest group's share of used blocks: the group that runs out first is what preempts
    and refuses admission.
    """

    def __init__(
        self,
        num_blocks: int | KVCacheLayout,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ) -> None:
        """``num_blocks``: one full-attention group of that many blocks (and
        ``num_cpu_blocks`` swap blocks), or a layout that gives every group's counts."""
        if isinstance(num_blocks, KVCacheLayout):
            layout = num_blocks
            if num_cpu_blocks:
                raise ValueError("num_cpu_blocks: a KVCacheLayout carries its own CPU blocks")
        else:
            if num_blocks <= 0:
                raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
            layout = KVCacheLayout.single(num_blocks, num_cpu_blocks)
        self.layout = layout
        self.num_blocks = layout.total_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = [
            KVCacheGroup(spec, offset, n, cpu_offset, n_cpu, block_size)
            for spec, offset, n, cpu_offset, n_cpu in zip(
                layout.specs,
                layout.offsets,
                layout.num_blocks,
                layout.cpu_offsets,
                layout.num_cpu_blocks,
            )
        ]
        self.blocks = [b for g in self.groups for b in g.blocks]
        self.num_cpu_blocks = layout.total_cpu_blocks
        # (src, dst, request_id) copy-on-write pairs not yet handed to a step.
        self.pending_copies: list[tuple[int, int, str]] = []
        self.prefix_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.prefix_hits = 0  # of those, found cached

    # ---- prefix cache -------------------------------------------------------------------

    def block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
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
        The blocks are every group's table prefix, one group after the other.

        At least one token is always left to compute, since the step must produce logits. A
        request that wants prompt logprobs, or one that says ``skip_prefix_cache`` (mean
        pooling), gets no hits: every prompt position must be computed.
        """
        if not self.may_reuse(request):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request, max_blocks)
        hit = self._longest_hit(hashes, max_blocks)
        if hit == 0:
            return [], 0
        blocks = [b for g in self.groups for b in g.hit_blocks(hashes, hit)]
        return blocks, hit * self.block_size

    def may_reuse(self, request: Request) -> bool:
        """Whether the request may start from blocks computed before (cached here or stored
        elsewhere): not with prefix caching off, prompt logprobs or ``skip_prefix_cache``."""
        return (
            self.enable_prefix_caching
            and not request.skip_prefix_cache
            and request.sampling_params.prompt_logprobs is None
        )

    def _longest_hit(self, hashes: list[bytes], limit: int) -> int:
        """Leading blocks (at most ``limit``) of this hash chain that every group holds."""
        hit = limit
        while True:
            # Each group's longest hit at most ``hit``; a sliding group's may be shorter than
            # a later group's, so go round until every group agrees.
            agreed = hit
            for group in self.groups:
                agreed = group.longest_hit(hashes, agreed)
            if agreed == hit:
                return hit
            hit = agreed

    def cached_prefix_tokens(
        self, token_ids: list[int], cache_salt: str | None = None, lora: str | None = None
    ) -> int:
        """Tokens of a prompt's leading blocks cached here now, as a request with this salt
        and adapter (``LoRARequest.prefix_key``) would find them; nothing is changed."""
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        hashes: list[bytes] = []
        for i in range((len(token_ids) - 1) // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(
                hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], cache_salt, lora)
            )
        return self._longest_hit(hashes, len(hashes)) * bs

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        for group in self.groups:
            group.cache_blocks(request, self.block_hashes)

    # ---- allocation ---------------------------------------------------------------------

    def _by_group(self, blocks: list[KVCacheBlock]) -> list[list[KVCacheBlock]]:
        if len(self.groups) == 1:
            return [blocks]
        out: list[list[KVCacheBlock]] = [[] for _ in self.groups]
        for block in blocks:
            out[self.layout.group_of(block.block_id)].append(block)
        return out

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's block tables to hold ``num_new_tokens`` more tokens.

        ``new_computed_blocks`` (prefix-cache hits, first schedule only) are prepended first.
        Sliding groups first free the blocks that fell out of the window. Returns the newly
        allocated blocks (every group's), or None (and allocates nothing) if they do not fit.
        """
        computed = self._by_group(new_computed_blocks or [])
        plans = []
        for group, hits in zip(self.groups, computed):
            group.free_outside_window(request)
            plan = group.can_allocate(request, num_new_tokens, hits)
            if plan is None:
                return None
            plans.append(plan)
        new_blocks: list[KVCacheBlock] = []
        for group, hits, (needed, shared) in zip(self.groups, computed, plans):
            new_blocks += group.allocate(
                request.request_id, needed, shared, hits, self.pending_copies
            )
        return new_blocks

    def take_copies(self) -> list[tuple[int, int, str]]:
        """The copy-on-write pairs queued since the last call, for this step's workers."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Give ``child`` the parent's blocks that hold tokens ``[0, num_tokens)``: shared, one
        more reference each; a partially filled last one is copied when the child writes."""
        num_blocks = -(-num_tokens // self.block_size)
        for group in self.groups:
            group.fork(parent.request_id, child.request_id, num_blocks)

    def free(self, request: Request) -> None:
        """Release the request's device blocks (cached ones stay cached, evictable)."""
        for group in self.groups:
            group.free(request.request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: every group's, one after the other."""
        return [b.block_id for g in self.groups for b in g.req_to_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Blocks the request holds in each group (null entries not counted)."""
        return [len(g.held_blocks(request_id)) for g in self.groups]

    # ---- swapping -----------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        return all(
            len(g.held_blocks(request.request_id)) <= len(g.free_cpu_blocks) for g in self.groups
        )

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to CPU swap space; returns (device block, cpu block) pairs."""
        return [pair for g in self.groups for pair in g.swap_out(request.request_id)]

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        """Whether the swapped request's blocks fit back, with room for ``num_new_tokens``
        more tokens after its computed ones."""
        end = request.num_computed_tokens + num_new_tokens
        for group in self.groups:
            rid = request.request_id
            held = len(group.req_to_cpu_blocks.get(rid, ()))
            logical = held + group.swapped_skipped.get(rid, 0)
            extra = max(0, -(-end // self.block_size) - logical)
            if held + extra > len(group.free_queue):
                return False
        return True

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request back; returns (cpu block, device block) pairs."""
        return [pair for g in self.groups for pair in g.swap_in(request.request_id)]

    def free_swapped(self, request: Request) -> None:
        for group in self.groups:
            group.free_swapped(request.request_id)

    # ---- introspection ------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Free device blocks, every group's."""
        return sum(len(g.free_queue) for g in self.groups)

    @property
    def free_cpu_blocks(self) -> list[int]:
        return [c for g in self.groups for c in g.free_cpu_blocks]

    def table_sizes(self) -> dict[str, int]:
        """Per-request entries held, summed over the groups (all 0 once idle)."""
        groups = self.groups
        return {
            "block_tables": sum(len(g.req_to_blocks) for g in groups),
            "cpu_block_tables": sum(len(g.req_to_cpu_blocks) for g in groups),
            "cached_block_counts": sum(len(g.num_cached_blocks) for g in groups),
            "skipped_block_counts": sum(
                len(g.num_skipped) + len(g.swapped_skipped) for g in groups
            ),
            "pending_copies": len(self.pending_copies),
        }

    def stats(self) -> KVCacheStats:
        total = sum(g.num_usable for g in self.groups)
        free = sum(len(g.free_queue) for g in self.groups)
        cached_free = sum(1 for g in self.groups for b in g.free_queue if b.block_hash is not None)
        return KVCacheStats(
            total=total,
            free=free,
            cached=cached_free,
            used=total - free,
            cpu_total=self.num_cpu_blocks,
            cpu_free=sum(len(g.free_cpu_blocks) for g in self.groups),
            group_usage=tuple(
                (g.num_usable - len(g.free_queue)) / g.num_usable if g.num_usable else 0.0
                for g in self.groups
            ),
        )

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` describing the first broken invariant, if any."""
        first = self.groups[0].req_to_blocks
        for group in self.groups:
            group.check_integrity()
            for rid in first.keys() | group.req_to_blocks.keys():
                if len(group.req_to_blocks.get(rid, ())) != len(first.get(rid, ())):
                    raise RuntimeError(f"request {rid!r}: its groups' tables differ in length")
