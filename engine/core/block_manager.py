"""PagedAttention block manager: physical KV blocks, block tables, ref counts, prefix caching.

    request block table (logical order)      physical pool (num_blocks blocks of block_size slots)
    req A: [7, 2, 9]                         ┌───┬───┬───┬───┬───┬───┬───┬───┬───┬───┐
    req B: [7, 4]      (block 7 shared)      │ 0 │ 1 │ 2 │ 3 │ 4 │ 5 │ 6 │ 7 │ 8 │ 9 │
                                             └───┴───┴───┴───┴───┴───┴───┴───┴───┴───┘
    slot of token t = block_table[t // block_size] * block_size + t % block_size

Invariants (``check_integrity``): a block is in the free queue iff its ref count is 0; its ref
count equals the number of block tables holding it; free + used = total. Full computed blocks
are registered in the prefix cache by their chained hash and stay cached once freed, until
evicted. Shared blocks are copy-on-write (``BlockManager``). Each KV cache group
(``engine.core.kv_cache_groups``) is a ``KVCacheGroup`` (``engine.core.block_pool``: its own
pool and block table per request over global block ids); ``BlockManager`` acts on every group
at once and ``get_block_ids`` lists a request's groups one after the other.
docs/kv_cache_groups.md has the sliding-window rules (freeing, prefix hits, swap,
``stats().usage``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_pool import KVCacheBlock, KVCacheGroup, hash_block_tokens
from engine.core.kv_cache_groups import KVCacheLayout
from engine.core.request import Request
from engine.multimodal.inputs import whole_image_prefix


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
            mm = tuple(f.mm_hash for f in request.mm_features if f.overlaps(i * bs, (i + 1) * bs))
            hashes.append(hash_block_tokens(parent, tokens, request.cache_salt, lora, mm))
        return hashes

    def get_computed_blocks(
        self, request: Request, *, whole_images: bool = False
    ) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a request about to be scheduled: (blocks, num tokens).
        The blocks are every group's table prefix, one group after the other.

        At least one token is always left to compute, since the step must produce logits. A
        request that wants prompt logprobs, or one that says ``skip_prefix_cache`` (mean
        pooling), gets no hits: every prompt position must be computed. ``whole_images``
        (``disable_chunked_mm_input``): a hit that would end inside an image backs off to the
        block before the image, so the image's tokens are computed in one chunk.
        """
        if not self.may_reuse(request):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request, max_blocks)
        hit = self._longest_hit(hashes, max_blocks)
        while whole_images and hit:
            bs = self.block_size
            safe = whole_image_prefix(request.mm_features, hit * bs, bs) // bs
            if safe == hit:
                break
            hit = self._longest_hit(hashes, safe)  # a window group may hold less of it
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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``), as when the cache's
        contents are gone; False, and nothing changed, while a request holds blocks."""
        if any(g.req_to_blocks or g.req_to_cpu_blocks for g in self.groups):
            return False
        for group in self.groups:
            group.reset_prefix_cache()
        return True

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

    def cancel_copies(self, request_id: str) -> dict[int, int]:
        """Drop the request's copy-on-write pairs not yet taken (it is preempted in the step
        that queued them); returns their destination -> source, so that a swap-out reads the
        source (what the destination would have held) and no copy writes into a block the
        request no longer has."""
        mine = [c for c in self.pending_copies if c[2] == request_id]
        self.pending_copies = [c for c in self.pending_copies if c[2] != request_id]
        return {dst: src for src, dst, _ in mine}

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
