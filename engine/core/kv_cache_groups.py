"""KV cache groups: which layers share a block table, and how many blocks each group's pool gets.
Torch-free (``cluster plan`` reads it); a step's per-group metadata is
``llm_kernels.attention_metadata.build_group_metadata``. The design, sizing and why-not-one-pool
are in docs/kv_cache_groups.md.

Layers are grouped by what their attention reads: every full-attention layer in one group, every
layer of one sliding window W in another (a window that covers ``max_model_len`` hides nothing
and counts as full attention). A DeepSeek model's multi-head latent caches are all of one kind
(its every layer is MLA, none windowed), so it is one group, like any model without windows.

One pool per group, block ids global. Group g owns the ids
``[offset_g, offset_g + num_blocks_g)`` and its layers' caches have ``num_blocks_g`` blocks
(local id = global id - offset_g); every id in a block table, a copy or a swap names its group by
its range, so the wire message is the one-group message with more ids in it and a model with one
group (offset 0) is exactly as before. A sliding group keeps its local block 0 as the *null
block*: never allocated, all zeros, it stands in a block table for a block that fell wholly
outside the window and went back to the pool.

    group 0 (full, N0 blocks)   ids 0 .. N0-1         table  [ 3,  9, 12, 40, 41]
    group 1 (window W, N1)      ids N0 .. N0+N1-1     table  [N0, N0, N0, 77, 80]   (N0: null)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine import hf_config

if TYPE_CHECKING:
    from engine.config import EngineConfig


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its layers' sliding window (None: full attention)."""

    sliding_window: int | None = None

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None


FULL_ATTENTION = KVCacheGroupSpec()


def group_window(window: int | None, max_model_len: int) -> int | None:
    """The window that decides a layer's group: None when it hides no key up to
    ``max_model_len`` (then the layer holds its whole context like a full-attention one)."""
    return None if window is None or window >= max_model_len else int(window)


def kv_cache_group_specs(hf: dict[str, Any], max_model_len: int) -> tuple[KVCacheGroupSpec, ...]:
    """The model's groups: full attention first (when any layer has it), then each sliding
    window, smallest first."""
    windows = {
        group_window(hf_config.layer_window(hf, t), max_model_len)
        for t in hf_config.layer_types(hf)
    }
    full = [FULL_ATTENTION] if None in windows else []
    return (*full, *(KVCacheGroupSpec(w) for w in sorted(w for w in windows if w is not None)))


def group_of_window(
    specs: Sequence[KVCacheGroupSpec], window: int | None, max_model_len: int
) -> int:
    """The index of the group a layer with this sliding window belongs to."""
    key = group_window(window, max_model_len)
    for i, spec in enumerate(specs):
        if spec.sliding_window == key:
            return i
    raise ValueError(
        f"sliding_window: a layer with window {window} fits none of the KV cache groups "
        f"{[s.sliding_window for s in specs]} (a draft model's windows must be the target's)"
    )


@dataclass(frozen=True)
class KVCacheLayout:
    """Each group's spec and pool size; the id ranges follow (see the module docstring)."""

    specs: tuple[KVCacheGroupSpec, ...]
    num_blocks: tuple[int, ...]
    num_cpu_blocks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.specs) == len(self.num_blocks) == len(self.num_cpu_blocks) >= 1):
            raise ValueError(
                f"KVCacheLayout: {len(self.specs)} specs, {len(self.num_blocks)} block counts "
                f"and {len(self.num_cpu_blocks)} CPU block counts must be equal and >= 1"
            )
        if min(self.num_blocks) < 0 or min(self.num_cpu_blocks) < 0:
            raise ValueError(
                f"KVCacheLayout: block counts must be >= 0, got {self.num_blocks} and "
                f"{self.num_cpu_blocks}"
            )

    @classmethod
    def single(cls, num_blocks: int, num_cpu_blocks: int = 0) -> KVCacheLayout:
        """One full-attention group: the layout of every model before groups."""
        return cls((FULL_ATTENTION,), (num_blocks,), (num_cpu_blocks,))

    @classmethod
    def uniform(
        cls, specs: Sequence[KVCacheGroupSpec], num_blocks: int, num_cpu_blocks: int
    ) -> KVCacheLayout:
        """Every group the same number of blocks."""
        n = len(specs)
        return cls(tuple(specs), (num_blocks,) * n, (num_cpu_blocks,) * n)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(s.sliding_window for s in self.specs)

    @property
    def offsets(self) -> tuple[int, ...]:
        return _offsets(self.num_blocks)

    @property
    def cpu_offsets(self) -> tuple[int, ...]:
        return _offsets(self.num_cpu_blocks)

    @property
    def total_blocks(self) -> int:
        return sum(self.num_blocks)

    @property
    def total_cpu_blocks(self) -> int:
        return sum(self.num_cpu_blocks)

    def group_of(self, block_id: int) -> int:
        """The group that owns a global device block id."""
        return bisect.bisect_right(self.offsets, block_id) - 1

    def cpu_group_of(self, cpu_block_id: int) -> int:
        return bisect.bisect_right(self.cpu_offsets, cpu_block_id) - 1

    def split(self, block_ids: Sequence[int]) -> list[list[int]]:
        """Global ids (a table, or a table's new entries) as each group's local ids, in order."""
        if len(self.specs) == 1:
            return [list(block_ids)]
        out: list[list[int]] = [[] for _ in self.specs]
        offsets = self.offsets
        for block_id in block_ids:
            g = bisect.bisect_right(offsets, block_id) - 1
            out[g].append(block_id - offsets[g])
        return out

    def split_pairs(
        self, pairs: Sequence[tuple[int, int]], *, device_first: bool
    ) -> list[list[tuple[int, int]]]:
        """Block-op pairs by group, as local ids: (device, cpu) pairs (swap out) with
        ``device_first``, (cpu, device) pairs (swap in) without; a copy's (src, dst) are both
        device ids (``split_copies``)."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.specs]
        offsets, cpu_offsets = self.offsets, self.cpu_offsets
        for a, b in pairs:
            device = a if device_first else b
            g = bisect.bisect_right(offsets, device) - 1
            if device_first:
                out[g].append((a - offsets[g], b - cpu_offsets[g]))
            else:
                out[g].append((a - cpu_offsets[g], b - offsets[g]))
        return out

    def split_copies(self, pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        out: list[list[tuple[int, int]]] = [[] for _ in self.specs]
        offsets = self.offsets
        for src, dst in pairs:
            g = bisect.bisect_right(offsets, src) - 1
            out[g].append((src - offsets[g], dst - offsets[g]))
        return out


def _offsets(counts: Sequence[int]) -> tuple[int, ...]:
    out, total = [], 0
    for n in counts:
        out.append(total)
        total += n
    return tuple(out)


def sliding_blocks_per_seq(window: int, block_size: int, step_tokens: int) -> int:
    """Blocks a sliding layer holds for one sequence after a step of ``step_tokens`` tokens:
    the keys ``[c - W + 1, c + step_tokens)`` span at most this many blocks."""
    return -(-(window - 1 + step_tokens) // block_size) + 1


def plan_group_blocks(
    specs: Sequence[KVCacheGroupSpec],
    num_blocks: int,
    num_cpu_blocks: int,
    group_block_bytes: Sequence[Sequence[int]],
    *,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    decode_tokens: int,
    batches_in_flight: int,
) -> KVCacheLayout:
    """Each group's pool from the workers' ``num_blocks`` all-layer blocks (one block in every
    layer). Each sliding group gets what it can fill: ``max_num_seqs`` decoding sequences
    holding ``ceil((W - 1 + s) / block_size) + 1`` blocks each (s: the tokens of one decode
    step, speculative ones included), plus one full prefill chunk per batch in flight and the
    null block, capped at ``num_blocks``. The bytes this saves go to the full group. Since the
    scheduler preempts when any group runs out, and a sliding pool always holds one sequence's
    largest step, it never deadlocks; and no workload fits fewer sequences than in one pool for
    every layer. A model without a full group (Mistral: every layer windowed) splits nothing:
    each group gets ``num_blocks``; so does every model given an explicit ``num_kv_blocks`` (a
    fixed pool: what it preempts at does not move). docs/kv_cache_groups.md has the reasoning.
    ``group_block_bytes[w][g]``: bytes of one block of group g's layers on worker w
    (0 where a pipeline stage has none); ``decode_tokens``: the slots one decode step may take
    (1, plus speculative proposals and draft lookahead)."""
    if len(specs) == 1 or all(s.is_sliding for s in specs):
        return KVCacheLayout.uniform(specs, num_blocks, num_cpu_blocks)
    max_blocks_per_seq = -(-max_model_len // block_size)
    chunk_blocks = -(-min(max_num_batched_tokens, max_model_len) // block_size)
    counts = []
    for spec in specs:
        if not spec.is_sliding:
            counts.append(num_blocks)
            continue
        per_seq = sliding_blocks_per_seq(spec.sliding_window or 0, block_size, decode_tokens)
        can_fill = max_num_seqs * min(per_seq, max_blocks_per_seq) + chunk_blocks * max(
            1, batches_in_flight
        )
        counts.append(min(num_blocks, can_fill + 1))
    full = next(i for i, s in enumerate(specs) if not s.is_sliding)
    extra = []
    for per_group in group_block_bytes:
        if per_group[full] <= 0:
            continue  # this stage has no full-attention layer: it is not the constraint
        saved = sum((num_blocks - counts[g]) * per_group[g] for g in range(len(specs)) if g != full)
        extra.append(saved // per_group[full])
    # Never more than the scheduler can fill (the workers' own cap when they applied one).
    can_fill_full = max(num_blocks, max_num_seqs * max_blocks_per_seq)
    counts[full] = min(num_blocks + min(extra, default=0), can_fill_full)
    return KVCacheLayout(tuple(specs), tuple(counts), (num_cpu_blocks,) * len(specs))


def request_block_capacity(
    layout: KVCacheLayout, block_size: int, max_model_len: int, step_tokens: int = 1
) -> int:
    """The most blocks one request may hold, as the input checks count them: the smallest full
    group's pool, or a max_model_len sequence's blocks without a full group. A sliding group
    holds only a window of the request, unless its pool (less the null block) is smaller than
    one sequence's largest step (``step_tokens``: a full prefill chunk plus lookahead slots,
    as ``sliding_blocks_per_seq`` counts it): then a request is served only if all its blocks
    fit that pool, since a step needs every block it writes or reads at once (a fixed small
    ``num_kv_blocks``; a request past it would wait forever)."""
    max_blocks = -(-max_model_len // block_size)
    caps = []
    for spec, n in zip(layout.specs, layout.num_blocks):
        if not spec.is_sliding:
            caps.append(n)
            continue
        usable = n - 1  # the null block
        per_seq = sliding_blocks_per_seq(spec.sliding_window or 0, block_size, step_tokens)
        step = min(per_seq, max_blocks)
        if usable < step:
            caps.append(usable)
    return min(caps, default=max_blocks)


def config_layout(
    config: EngineConfig,
    num_blocks: int,
    num_cpu_blocks: int,
    group_block_bytes: Sequence[Sequence[int]],
    *,
    batches_in_flight: int,
) -> KVCacheLayout:
    """The engine's layout from the workers' all-layer block counts: ``plan_group_blocks`` for
    a model with several groups; an explicit ``num_kv_blocks`` gives every group that many."""
    specs = kv_cache_group_specs(config.model.hf_config, config.max_model_len)
    if len(specs) == 1 or config.cache.num_kv_blocks is not None:
        return KVCacheLayout.uniform(specs, num_blocks, num_cpu_blocks)
    spec = config.speculative.speculative_config
    k = spec.num_speculative_tokens if spec is not None else 0
    lookahead = k if spec is not None and spec.method == "draft_model" else 0
    return plan_group_blocks(
        specs,
        num_blocks,
        num_cpu_blocks,
        group_block_bytes,
        block_size=config.cache.block_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        decode_tokens=1 + k + lookahead,
        batches_in_flight=batches_in_flight,
    )


def describe_layout(
    layout: KVCacheLayout,
    group_block_bytes: Sequence[Sequence[int]],
    block_size: int,
    max_model_len: int,
) -> list[str]:
    """One line per group for the start-up log: blocks, tokens, bytes across workers, swap."""
    lines = []
    for g, (spec, n) in enumerate(zip(layout.specs, layout.num_blocks)):
        block_bytes = sum(worker[g] for worker in group_block_bytes)
        kind = (
            "full attention"
            if spec.sliding_window is None
            else f"sliding window {spec.sliding_window}"
        )
        lines.append(
            f"KV cache group {g} ({kind}): {n} blocks x {block_size} tokens = {n * block_size} "
            f"tokens ({n * block_size / max_model_len:.1f}x max_model_len {max_model_len}), "
            f"{n * block_bytes / (1 << 30):.2f} GiB across workers; swap space: "
            f"{layout.num_cpu_blocks[g]} blocks"
        )
    return lines
