"""The step metadata and the plans every attention path shares: ``AttentionMetadata`` (the
packed batch's positions, slots, block tables and context lengths, built once per step and
read by every layer), its torch-path plan (``DecodeGroup``: decode requests attended in one
padded call; ``PrefillChunk``: one prefill request's rows and blocks), the window plans of
sliding-window layers, and ``GatherWorkspace``, the K/V gather buffers a step's layers share.
The kernels that read them: ``llm_kernels.attention`` (torch), ``llm_kernels.triton_attention``,
``llm_kernels.cpu_decode``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

# A decode group only grows while its longest request needs at most this factor more blocks than
# its shortest one, which bounds the padded gather at twice the real one...
_DECODE_GROUP_MAX_PADDING_FACTOR = 2
# ...unless the group is short anyway: below this many blocks an extra group costs more in
# per-call overhead than the padding it would save.
_DECODE_GROUP_MIN_SPLIT_BLOCKS = 8


class GatherWorkspace:
    """Scratch buffers for the K/V gathers, reused by every layer that shares one metadata.

    A decode batch gathers tens of MB of K/V per layer. On CPU, allocating that fresh each time
    costs more in first-touch page faults than the copy itself (glibc serves large blocks with
    mmap and unmaps them on free), so the buffers live as long as the step's metadata.
    Invariant that makes reuse safe: a gather is consumed by its SDPA call before the next
    gather takes the buffer, so calls sharing one metadata must not run concurrently.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}

    def take(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """An uninitialized ``shape`` view of buffer ``name``, grown when too small."""
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)


@dataclass(frozen=True)
class DecodeGroup:
    """Decode requests (one new token each) attended together in one padded SDPA call.

    Invariant: ``block_ids`` holds, per request, ``max_blocks`` consecutive block-table entries
    (its first ones; from its window's first block on in a window's plan); entries past
    ``ceil(seq_len / block_size)`` are 0 (a block that always exists) and every position they
    cover is False in ``key_mask``.
    """

    num_seqs: int
    max_blocks: int
    # int64 [num_seqs]: the packed-batch row of each request's single new token.
    token_rows: Tensor
    # int64 [num_seqs * max_blocks]: the requests' block-table rows, flattened for index_select.
    block_ids: Tensor
    # bool [num_seqs, 1, 1, max_blocks * block_size]: True where the gathered key is visible
    # (position < seq_len, and inside the window in a window's plan).
    key_mask: Tensor
    # int64 [num_seqs]: each request's seq_len, from which a window's plan is derived.
    seq_lens: Tensor


@dataclass(frozen=True)
class PrefillChunk:
    """One request with ``query_len > 1``: rows ``token_start:token_end`` of the packed batch,
    the last ``token_end - token_start`` positions of its ``seq_len``-token context."""

    token_start: int
    token_end: int
    seq_len: int
    # int64: the request's meaningful block-table entries from the one holding key_start on.
    block_ids: Tensor
    # Position of the first gathered key, a multiple of block_size: 0, or in a window's plan
    # the start of the block holding the first query's earliest visible key.
    key_start: int = 0
    # Position ranges [start, end) inside this chunk whose tokens also see each other's later
    # keys (one image of Gemma 3: HF's token_type_ids blocks); a window still applies.
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class AttentionPlan:
    """How the torch path attends one step: its decode groups and prefill chunks."""

    decode_groups: tuple[DecodeGroup, ...]
    prefill_chunks: tuple[PrefillChunk, ...]


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step, built once and shared by every layer.

    The device tensors (``slot_mapping``, ``block_table``, ``seq_lens``, ``query_start_loc``) are
    the contract for the fused kernels; ``decode_groups`` and ``prefill_chunks`` are the torch
    path's precomputed plan, so a layer does no host-to-device copy and no per-token Python loop.

    How the torch path batches work (decided once per step in ``build``): decode requests
    (``query_len == 1``) are sorted by context length and cut into a few ``DecodeGroup``s whose
    padding is bounded, each one block gather plus one SDPA call; every other request is a
    ``PrefillChunk`` of its own (there are few per step), so one long prefill never pads the
    decode requests sharing its batch, nor they it. Layers share the metadata but not their
    window (Gemma 2 alternates windowed and global layers): see ``window_plan``.
    """

    num_seqs: int
    num_tokens: int
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Largest physical block id referenced; checked against each layer's kv_cache.
    max_block_id: int
    # int64 [num_tokens]: where each new token's K/V is written; < 0 means "do not write".
    slot_mapping: Tensor
    # int32 [num_seqs, max_blocks_per_seq]: physical block ids in logical order, padded with 0.
    block_table: Tensor
    # int32 [num_seqs]: context length including this step's new tokens.
    seq_lens: Tensor
    # int32 [num_seqs + 1]: request b's rows are query_start_loc[b]:query_start_loc[b + 1].
    query_start_loc: Tensor
    decode_groups: tuple[DecodeGroup, ...]
    prefill_chunks: tuple[PrefillChunk, ...]
    # int32 [num_decode]: the requests with query_len == 1, for a native decode kernel
    # (``llm_kernels.cpu_decode``) that attends them all in one call instead of by groups.
    decode_seqs: Tensor | None = None
    # Scratch for the K/V gathers, shared by the layers of this step (see GatherWorkspace).
    workspace: GatherWorkspace = field(default_factory=GatherWorkspace, repr=False, compare=False)
    # Window size -> the plan restricted to it, filled on first use by window_plan.
    window_plans: dict[int, AttentionPlan] = field(default_factory=dict, repr=False, compare=False)
    # A model whose layers hold different block tables (KV cache groups: full attention, each
    # sliding window) has one metadata per group here, group 0 first; empty with one group.
    groups: tuple[AttentionMetadata, ...] = field(default=(), repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    @property
    def has_bidirectional(self) -> bool:
        """Whether a prefill chunk of this step has spans attended both ways (only the torch
        path's masked prefill attends them)."""
        return any(chunk.bidirectional for chunk in self.prefill_chunks)

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of the layers of KV cache group ``group`` (this one with one group)."""
        return self.groups[group] if self.groups else self

    def window_plan(self, sliding_window: int) -> AttentionPlan:
        """The plan of a layer with this sliding window: each decode group reads only the
        blocks that can hold keys inside its requests' windows, each chunk only the blocks
        from its first query's window on. Derived on first use and cached per window size: a
        decode group gathers only the last ``ceil((W - 1) / block_size) + 1`` blocks of each
        request (as many as W consecutive positions can touch)."""
        plan = self.window_plans.get(sliding_window)
        if plan is None:
            plan = AttentionPlan(
                decode_groups=tuple(
                    _window_decode_group(g, sliding_window, self.block_size)
                    for g in self.decode_groups
                ),
                prefill_chunks=tuple(
                    _window_prefill_chunk(c, sliding_window, self.block_size)
                    for c in self.prefill_chunks
                ),
            )
            self.window_plans[sliding_window] = plan
        return plan

    @classmethod
    def build(
        cls,
        *,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
        slot_mapping: np.ndarray,
        block_size: int,
        device: torch.device,
        bidirectional: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> AttentionMetadata:
        """Validate one step's host-side batch description and move it to ``device``.

        ``query_lens``/``seq_lens`` are integer ``[B]``; ``block_table`` is integer
        ``[B, max_blocks_per_seq]`` where only the first ``ceil(seq_len / block_size)`` entries
        of a row are meaningful; ``slot_mapping`` is integer ``[query_lens.sum()]``;
        ``bidirectional`` (per request, or None) the position spans of its new tokens that
        attend each other both ways (``PrefillChunk.bidirectional``), each inside the request's
        new tokens of a request with ``query_len > 1``.
        """
        query_lens_np = _as_int_array("query_lens", query_lens, ndim=1)
        seq_lens_np = _as_int_array("seq_lens", seq_lens, ndim=1)
        block_table_np = _as_int_array("block_table", block_table, ndim=2)
        slot_mapping_np = _as_int_array("slot_mapping", slot_mapping, ndim=1)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        num_seqs = len(query_lens_np)
        if len(seq_lens_np) != num_seqs:
            raise ValueError(
                f"seq_lens has {len(seq_lens_np)} entries but query_lens has {num_seqs}"
            )
        if block_table_np.shape[0] != num_seqs:
            raise ValueError(
                f"block_table has {block_table_np.shape[0]} rows but query_lens has {num_seqs}"
            )
        if (query_lens_np < 0).any():
            raise ValueError(f"query_lens must be >= 0, got {query_lens_np.tolist()}")
        if (seq_lens_np < query_lens_np).any():
            raise ValueError(
                "seq_lens must be >= query_lens (seq_len counts the new tokens), got "
                f"seq_lens={seq_lens_np.tolist()} query_lens={query_lens_np.tolist()}"
            )
        num_tokens = int(query_lens_np.sum())
        if len(slot_mapping_np) != num_tokens:
            raise ValueError(
                f"slot_mapping has {len(slot_mapping_np)} entries but query_lens sums to "
                f"{num_tokens}"
            )
        num_blocks_per_seq = -(-seq_lens_np // block_size)
        max_blocks_needed = int(num_blocks_per_seq.max(initial=0))
        if block_table_np.shape[1] < max_blocks_needed:
            raise ValueError(
                f"block_table has {block_table_np.shape[1]} columns but a seq_len of "
                f"{int(seq_lens_np.max())} needs {max_blocks_needed} blocks of {block_size}"
            )
        # Only the meaningful prefix of each row is trusted; the rest is forced to block 0 so
        # that padded gathers read a block that exists.
        meaningful = np.arange(block_table_np.shape[1])[None, :] < num_blocks_per_seq[:, None]
        block_table_np = np.where(meaningful, block_table_np, 0)
        if (block_table_np < 0).any():
            raise ValueError("block_table entries within a request's seq_len must be >= 0")

        query_start_loc_np = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens_np, out=query_start_loc_np[1:])
        return cls(
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            block_size=block_size,
            max_query_len=int(query_lens_np.max(initial=0)),
            max_seq_len=int(seq_lens_np.max(initial=0)),
            max_block_id=int(block_table_np.max(initial=0)),
            slot_mapping=_to_device(slot_mapping_np, torch.int64, device),
            block_table=_to_device(block_table_np, torch.int32, device),
            seq_lens=_to_device(seq_lens_np, torch.int32, device),
            query_start_loc=_to_device(query_start_loc_np, torch.int32, device),
            decode_groups=_plan_decode_groups(
                query_lens_np, seq_lens_np, block_table_np, query_start_loc_np, block_size, device
            ),
            prefill_chunks=_plan_prefill_chunks(
                query_lens_np,
                seq_lens_np,
                block_table_np,
                query_start_loc_np,
                block_size,
                device,
                _check_spans(bidirectional, query_lens_np, seq_lens_np),
            ),
            decode_seqs=_to_device(np.flatnonzero(query_lens_np == 1), torch.int32, device),
        )


def build_group_metadata(
    *,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: Sequence[np.ndarray],
    windows: Sequence[int | None],
    positions: np.ndarray,
    req_index: np.ndarray,
    block_size: int,
    device: torch.device,
    bidirectional: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> AttentionMetadata:
    """One step's metadata when layers hold different block tables (KV cache groups): one
    ``block_tables[g]`` per group, of layers with sliding window ``windows[g]`` (None: full
    attention); group 0's metadata carries them all in ``groups`` (``for_group``). The slots
    follow from each table and ``positions`` (of the packed tokens, request ``req_index``).

    A windowed group's entries wholly before each request's first query's window may name
    blocks that went back to the pool; they are set to block 0 (the group's null block) here,
    so no path reads them, whatever tile it starts from."""
    starts = seq_lens - query_lens
    built: list[AttentionMetadata] = []
    for table, window in zip(block_tables, windows):
        if window is not None:
            first = np.maximum(starts - window + 1, 0) // block_size
            table = np.where(np.arange(table.shape[1])[None, :] < first[:, None], 0, table)
        slots = table[req_index, positions // block_size].astype(np.int64) * block_size
        metadata = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_table=table,
            slot_mapping=slots + positions % block_size,
            block_size=block_size,
            device=device,
            bidirectional=bidirectional,
        )
        if built:  # the groups' layers run one after another: one gather workspace will do
            metadata = dataclasses.replace(metadata, workspace=built[0].workspace)
        built.append(metadata)
    if len(built) == 1:
        return built[0]
    return dataclasses.replace(built[0], groups=tuple(built))


def effective_window(sliding_window: int | None, metadata: AttentionMetadata) -> int | None:
    """``sliding_window`` as an int, or None when it hides no key of this step (no context is
    longer than it), so that such calls run exactly the unwindowed path."""
    if sliding_window is None or sliding_window >= metadata.max_seq_len:
        return None
    return int(sliding_window)


def _plan_decode_groups(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    query_start_loc: np.ndarray,
    block_size: int,
    device: torch.device,
) -> tuple[DecodeGroup, ...]:
    decode_seqs = np.flatnonzero(query_lens == 1)
    num_blocks = -(-seq_lens[decode_seqs] // block_size)
    order = np.argsort(num_blocks, kind="stable")
    decode_seqs, num_blocks = decode_seqs[order], num_blocks[order]

    groups: list[DecodeGroup] = []
    start = 0
    for end in range(1, len(decode_seqs) + 1):
        # Sorted by length, so a group's first member is its shortest and num_blocks[end] its
        # longest if it were added.
        if end < len(decode_seqs) and (
            num_blocks[end] <= _DECODE_GROUP_MIN_SPLIT_BLOCKS
            or num_blocks[end] <= _DECODE_GROUP_MAX_PADDING_FACTOR * num_blocks[start]
        ):
            continue
        seqs = decode_seqs[start:end]
        max_blocks = int(num_blocks[end - 1])
        positions = torch.arange(max_blocks * block_size, device=device)
        group_seq_lens = _to_device(seq_lens[seqs], torch.int64, device)
        groups.append(
            DecodeGroup(
                num_seqs=len(seqs),
                max_blocks=max_blocks,
                token_rows=_to_device(query_start_loc[seqs], torch.int64, device),
                block_ids=_to_device(block_table[seqs, :max_blocks].ravel(), torch.int64, device),
                key_mask=(positions[None, :] < group_seq_lens[:, None])[:, None, None, :],
                seq_lens=group_seq_lens,
            )
        )
        start = end
    return tuple(groups)


def _window_decode_group(group: DecodeGroup, window: int, block_size: int) -> DecodeGroup:
    """``group`` restricted to each request's window ``seq_len - window <= k < seq_len``: the
    ``ceil((window - 1) / block_size) + 1`` blocks from the one holding its first key on, which
    is as many as ``window`` consecutive positions can touch."""
    max_blocks = min(group.max_blocks, -(-(window - 1) // block_size) + 1)
    device = group.block_ids.device
    window_start = (group.seq_lens - window).clamp_(min=0)
    # Logical block numbers [num_seqs, max_blocks]; those past a request's last block read a
    # clamped (existing) table column and cover only positions >= seq_len, which the mask hides.
    logical = window_start[:, None] // block_size + torch.arange(max_blocks, device=device)
    table = group.block_ids.view(group.num_seqs, group.max_blocks)
    block_ids = table.gather(1, logical.clamp(max=group.max_blocks - 1))
    positions = (logical[:, :, None] * block_size + torch.arange(block_size, device=device)).view(
        group.num_seqs, -1
    )
    key_mask = (positions >= window_start[:, None]) & (positions < group.seq_lens[:, None])
    return dataclasses.replace(
        group,
        max_blocks=max_blocks,
        block_ids=block_ids.ravel(),
        key_mask=key_mask[:, None, None, :],
    )


def _window_prefill_chunk(chunk: PrefillChunk, window: int, block_size: int) -> PrefillChunk:
    """``chunk`` without the blocks wholly before its first query's window."""
    query_len = chunk.token_end - chunk.token_start
    first_block = max(chunk.seq_len - query_len - window + 1, 0) // block_size
    return dataclasses.replace(
        chunk, block_ids=chunk.block_ids[first_block:], key_start=first_block * block_size
    )


def _plan_prefill_chunks(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    query_start_loc: np.ndarray,
    block_size: int,
    device: torch.device,
    bidirectional: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> tuple[PrefillChunk, ...]:
    return tuple(
        PrefillChunk(
            token_start=int(query_start_loc[b]),
            token_end=int(query_start_loc[b + 1]),
            seq_len=int(seq_lens[b]),
            block_ids=_to_device(
                block_table[b, : -(-int(seq_lens[b]) // block_size)], torch.int64, device
            ),
            bidirectional=tuple(bidirectional[b]) if bidirectional is not None else (),
        )
        for b in np.flatnonzero(query_lens > 1)
    )


def _check_spans(
    spans: Sequence[Sequence[tuple[int, int]]] | None,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
) -> list[list[tuple[int, int]]] | None:
    """``spans`` as int pairs, each inside its request's new tokens (a span split across
    steps could not see its later part: the scheduler keeps them whole)."""
    if spans is None:
        return None
    if len(spans) != len(query_lens):
        raise ValueError(f"bidirectional has {len(spans)} entries but query_lens {len(query_lens)}")
    out = []
    for b, request_spans in enumerate(spans):
        start, end = int(seq_lens[b] - query_lens[b]), int(seq_lens[b])
        pairs = [(int(lo), int(hi)) for lo, hi in request_spans]
        for lo, hi in pairs:
            if not start <= lo < hi <= end or (query_lens[b] == 1 and hi - lo > 1):
                raise ValueError(
                    f"bidirectional span [{lo}, {hi}) of request {b} is not inside its new "
                    f"tokens [{start}, {end}): a span must be computed in one step"
                )
        out.append(pairs)
    return out


def _as_int_array(name: str, array: np.ndarray, *, ndim: int) -> np.ndarray:
    array = np.asarray(array)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {list(array.shape)}")
    return array.astype(np.int64)


def _to_device(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> Tensor:
    # Copy: callers may reuse their numpy buffers for the next step while this one runs.
    return torch.tensor(array, dtype=dtype, device=device)
