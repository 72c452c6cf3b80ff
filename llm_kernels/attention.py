"""PagedAttention in plain torch: the CPU serving path and the reference for the Triton kernels
and the native CPU decode kernel (``llm_kernels.cpu_decode``, which takes over the decode rows
through ``paged_attention``'s ``decode_kernel`` hook). It also holds the step metadata and plans the
kernels share (``AttentionMetadata``: decode groups, prefill chunks, window plans) and the
argument checks; FP8 KV quantization is ``llm_kernels.kv_quant``.

KV cache layout, one tensor per layer (FP8: float8_e4m3fn with one ``k_scale``/``v_scale``)::

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
             │  └─ physical block id      └─ offset inside the block
             └─ 0 = K, 1 = V              slot = block_id * block_size + offset

A one-plane cache ``kv_cache[1, ...]`` holds MLA's latent ``[kv_c | k_pe]``: key and value at
once (``reshape_and_cache`` writes the key alone, ``paged_attention`` takes ``v_head_dim``).
A request's ``block_table`` row lists its physical blocks in logical order (not necessarily
contiguous or sorted): position ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size``. A step's batch is packed:
request ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b+1]``, the last
``query_len[b]`` tokens of its ``seq_len[b]``-token context, whose K/V ``reshape_and_cache``
writes before attention runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from llm_kernels.kv_quant import as_storage, check_kv_scale, dequantize_kv, is_fp8, quantize_kv

__all__ = [
    "AttentionMetadata",
    "AttentionPlan",
    "DecodeGroup",
    "DecodeKernel",
    "GatherWorkspace",
    "PrefillChunk",
    "build_group_metadata",
    "check_attention_options",
    "check_sinks",
    "check_value_dim",
    "copy_blocks",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
]

# A decode group only grows while its longest request needs at most this factor more blocks than
# its shortest one, which bounds the padded gather at twice the real one...
_DECODE_GROUP_MAX_PADDING_FACTOR = 2
# ...unless the group is short anyway: below this many blocks an extra group costs more in
# per-call overhead than the padding it would save.
_DECODE_GROUP_MIN_SPLIT_BLOCKS = 8
# The explicit (soft-capped or sinked) route materializes float32 scores; a long prefill chunk is
# attended in slices of query rows so that they stay under this many elements (256 MiB).
_EXPLICIT_MAX_SCORES = 1 << 26


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
    ) -> AttentionMetadata:
        """Validate one step's host-side batch description and move it to ``device``.

        ``query_lens``/``seq_lens`` are integer ``[B]``; ``block_table`` is integer
        ``[B, max_blocks_per_seq]`` where only the first ``ceil(seq_len / block_size)`` entries
        of a row are meaningful; ``slot_mapping`` is integer ``[query_lens.sum()]``.
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
                query_lens_np, seq_lens_np, block_table_np, query_start_loc_np, block_size, device
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
        )
        if built:  # the groups' layers run one after another: one gather workspace will do
            metadata = dataclasses.replace(metadata, workspace=built[0].workspace)
        built.append(metadata)
    if len(built) == 1:
        return built[0]
    return dataclasses.replace(built[0], groups=tuple(built))


def reshape_and_cache(
    key: Tensor,
    value: Tensor | None,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    row_writer: CacheWriter | None = None,
) -> None:
    """Write the new tokens' ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into
    ``kv_cache`` at ``slot_mapping``; tokens whose slot is < 0 are not written. An FP8 cache
    stores them quantized with ``k_scale``/``v_scale`` (``llm_kernels.kv_quant``); other caches
    ignore the scales. A one-plane (latent) cache takes the key alone (``value`` None) and an
    FP8 one uses ``k_scale`` alone.

    ``row_writer`` (``llm_kernels.cpu_layer_kernels.write_cache_rows``; the ``cpu`` backend
    passes it) copies the rows where it covers the tensors; the masked ``index_copy_`` here is
    the path where it does not, and the reference it is tested against."""
    check_cache_write_args(key, value, kv_cache, slot_mapping)
    if row_writer is not None and row_writer(key, value, kv_cache, slot_mapping):
        return
    _, _, _, num_kv_heads, head_dim = kv_cache.shape

    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    rows = [(key[keep], k_scale, "k_scale")]
    if value is not None:
        rows.append((value[keep], v_scale, "v_scale"))
    storage = as_storage(kv_cache)
    for plane, (values, scale, scale_name) in enumerate(rows):
        if is_fp8(kv_cache):
            values = as_storage(quantize_kv(values, check_kv_scale(scale_name, scale)))
        storage[plane].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, values)


def paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    v_head_dim: int | None = None,
    sinks: Tensor | None = None,
    decode_kernel: DecodeKernel | None = None,
) -> Tensor:
    """Causal attention of the packed ``query`` ``[num_tokens, num_heads, head_dim]`` over each
    request's paged context; returns ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``
    (``[..., v_head_dim]`` over a one-plane latent cache, whose values are the first
    ``v_head_dim`` of each key's values; ``v_head_dim`` is given for such a cache only).

    Query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)`` (GQA/MQA). New token
    ``i`` of request ``b`` sits at position ``q = seq_len[b] - query_len[b] + i`` and sees keys
    ``k <= q``; with ``sliding_window`` W only ``q - W < k <= q`` (W keys at most, itself
    included: HF's convention). ``logits_soft_cap`` C turns the scaled scores into
    ``C * tanh(scores / C)`` before the mask and softmax (Gemma 2). ``sinks``
    (float ``[num_heads]``, on the query's device) adds ``exp(sinks[h])`` to head ``h``'s softmax
    denominator, a logit with no value (gpt-oss). An FP8 cache is dequantized with
    ``k_scale``/``v_scale`` (a one-plane cache: ``k_scale`` alone) into ``query.dtype`` as it is
    gathered; the Triton kernels do the same in-kernel. Scores and softmax accumulate in float32
    whatever the cache dtype (``sdpa_dtype``); the output is cast back.

    ``decode_kernel`` (``llm_kernels.cpu_decode.attend_decode``; the ``cpu`` backend passes it)
    attends every decode row in one native call where it covers the tensors; the decode groups
    are the path where it does not, and the reference it is tested against.
    """
    check_attention_args(query, kv_cache, metadata, scale)
    check_attention_options(sliding_window, logits_soft_cap)
    check_sinks(sinks, query)
    value_dim = check_value_dim(kv_cache, v_head_dim)
    sinks32 = None if sinks is None else sinks.to(torch.float32)
    dequant = KVDequant.of(query, kv_cache, k_scale, v_scale)
    window = effective_window(sliding_window, metadata)
    plan = (
        AttentionPlan(metadata.decode_groups, metadata.prefill_chunks)
        if window is None
        else metadata.window_plan(window)
    )

    # Contiguous even when `query` is a strided view (say, of a fused QKV projection), so that
    # the caller can flatten the heads for the output projection without a copy.
    out = torch.empty((*query.shape[:2], value_dim), dtype=query.dtype, device=query.device)
    # Every row of `out` is written: each request with query_len >= 1 is in exactly one decode
    # group or prefill chunk, and together they cover all num_tokens rows.
    decoded = (
        decode_kernel is not None
        and dequant is None
        and metadata.decode_seqs is not None
        and bool(plan.decode_groups)
        and decode_kernel(
            query,
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.decode_seqs,
            scale,
            window,
            logits_soft_cap,
            sinks32,
            out,
        )
    )
    for group in () if decoded else plan.decode_groups:
        _attend_decode_group(
            query,
            kv_cache,
            group,
            scale,
            logits_soft_cap,
            sinks32,
            metadata.workspace,
            dequant,
            out,
        )
    for chunk in plan.prefill_chunks:
        _attend_prefill_chunk(
            query,
            kv_cache,
            chunk,
            scale,
            window,
            logits_soft_cap,
            sinks32,
            metadata.workspace,
            dequant,
            out,
        )
    return out


class CacheWriter(Protocol):
    """A native cache write (``llm_kernels.cpu_layer_kernels.write_cache_rows``): it copies the
    rows with a slot >= 0 and returns True, or returns False without writing when it does not
    cover these tensors."""

    def __call__(
        self, key: Tensor, value: Tensor | None, kv_cache: Tensor, slot_mapping: Tensor
    ) -> bool: ...


class DecodeKernel(Protocol):
    """A native kernel for a step's decode rows (``llm_kernels.cpu_decode.attend_decode``): it
    writes their rows of ``out`` and returns True, or returns False without writing when it does
    not cover these tensors. ``sinks`` is float32 ``[num_heads]`` or None."""

    def __call__(
        self,
        query: Tensor,
        kv_cache: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
        query_start_loc: Tensor,
        decode_seqs: Tensor,
        scale: float,
        window: int | None,
        soft_cap: float | None,
        sinks: Tensor | None,
        out: Tensor,
    ) -> bool: ...


def check_attention_options(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """The optional arguments of a paged-attention call; shared by the torch and Triton kernels."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int | np.integer)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if logits_soft_cap is not None and (
        isinstance(logits_soft_cap, bool)
        or not isinstance(logits_soft_cap, int | float | np.number)
        or not math.isfinite(logits_soft_cap)
        or logits_soft_cap <= 0
    ):
        raise ValueError(
            f"logits_soft_cap must be None or a finite float > 0, got {logits_soft_cap!r}"
        )


def check_sinks(sinks: Tensor | None, query: Tensor) -> None:
    """Attention sinks: None, or one floating logit per query head on the query's device;
    shared by the torch and Triton kernels."""
    if sinks is None:
        return
    num_heads = query.shape[1]
    if not isinstance(sinks, Tensor) or sinks.shape != (num_heads,):
        got = list(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise ValueError(
            f"sinks must be None or a tensor of shape [{num_heads}] (num_heads), got {got}"
        )
    if not sinks.is_floating_point():
        raise ValueError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.device != query.device:
        raise ValueError(f"sinks is on {sinks.device} but query is on {query.device}")


def effective_window(sliding_window: int | None, metadata: AttentionMetadata) -> int | None:
    """``sliding_window`` as an int, or None when it hides no key of this step (no context is
    longer than it), so that such calls run exactly the unwindowed path."""
    if sliding_window is None or sliding_window >= metadata.max_seq_len:
        return None
    return int(sliding_window)


def check_cache_write_args(
    key: Tensor, value: Tensor | None, kv_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Shapes, dtypes and devices of a cache write; shared by the torch and Triton kernels. A
    one-plane (latent) cache takes no ``value``, a two-plane cache needs one."""
    check_kv_cache("kv_cache", kv_cache)
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    if (value is None) != (kv_cache.shape[0] == 1):
        raise ValueError(
            "value must be None for a one-plane (latent) kv_cache and a tensor for a K/V one, "
            f"got {'None' if value is None else 'a tensor'} for {kv_cache.shape[0]} plane(s)"
        )
    written = [("key", key)] if value is None else [("key", key), ("value", value)]
    for name, t in written:
        _check_same_device_dtype(name, t, kv_cache, fp8_ok=True)
        if t.dim() != 3 or t.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must have shape [num_tokens, {num_kv_heads}, {head_dim}] to match "
                f"kv_cache, got {list(t.shape)}"
            )
    if value is not None and key.shape != value.shape:
        raise ValueError(f"value has shape {list(value.shape)} but key has {list(key.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping must have shape [{key.shape[0]}] (one slot per key row), "
            f"got {list(slot_mapping.shape)}"
        )
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.device != kv_cache.device:
        raise ValueError(
            f"slot_mapping is on {slot_mapping.device} but kv_cache is on {kv_cache.device}"
        )


def check_attention_args(
    query: Tensor, kv_cache: Tensor, metadata: AttentionMetadata, scale: float
) -> None:
    """Shapes, dtypes and devices of a paged-attention call; shared by the torch and Triton
    kernels (the Triton wrapper adds its own constraints)."""
    check_kv_cache("kv_cache", kv_cache)
    _check_same_device_dtype("query", query, kv_cache, fp8_ok=True)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if query.dim() != 3:
        raise ValueError(
            f"query must have shape [num_tokens, num_heads, head_dim], got {list(query.shape)}"
        )
    num_tokens, num_heads, query_head_dim = query.shape
    if num_tokens != metadata.num_tokens:
        raise ValueError(
            f"query has {num_tokens} tokens but metadata describes {metadata.num_tokens}"
        )
    if query_head_dim != head_dim:
        raise ValueError(f"query has head_dim {query_head_dim} but kv_cache has {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query has {num_heads} heads but kv_cache has {num_kv_heads} kv heads; "
            "num_heads must be a multiple of num_kv_heads"
        )
    if block_size != metadata.block_size:
        raise ValueError(
            f"kv_cache has block_size {block_size} but metadata was built for {metadata.block_size}"
        )
    if metadata.max_block_id >= num_blocks:
        raise ValueError(
            f"metadata.block_table references block {metadata.max_block_id} but kv_cache has "
            f"{num_blocks} blocks"
        )
    if metadata.device != kv_cache.device:
        raise ValueError(f"metadata is on {metadata.device} but kv_cache is on {kv_cache.device}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")


def check_value_dim(kv_cache: Tensor, v_head_dim: int | None) -> int:
    """The values' head dim: the cache's own for a K/V cache (``v_head_dim`` None), or
    ``v_head_dim`` (1 to head_dim) over a one-plane latent cache, which requires it."""
    head_dim = kv_cache.shape[-1]
    if kv_cache.shape[0] == 2:
        if v_head_dim is not None and v_head_dim != head_dim:
            raise ValueError(
                f"v_head_dim is for a one-plane (latent) kv_cache; a K/V cache's values have "
                f"its head_dim {head_dim}, got {v_head_dim}"
            )
        return head_dim
    if (
        isinstance(v_head_dim, bool)
        or not isinstance(v_head_dim, int | np.integer)
        or not 1 <= v_head_dim <= head_dim
    ):
        raise ValueError(
            f"v_head_dim must be an int in [1, {head_dim}] for a one-plane (latent) kv_cache, "
            f"got {v_head_dim!r}"
        )
    return int(v_head_dim)


def copy_blocks(kv_caches: Sequence[Tensor], block_mapping: Tensor) -> None:
    """For every layer's cache (of either layout), copy block ``src`` into block ``dst`` for
    each row ``(src, dst)`` of ``block_mapping`` (int64 ``[K, 2]``); used for copy-on-write.

    All copies read the caches as they were before the call (gather, then scatter).
    """
    check_block_mapping(block_mapping)
    id_range = _id_range(block_mapping)
    for layer, kv_cache in enumerate(kv_caches):
        check_kv_cache(f"kv_caches[{layer}]", kv_cache)
        _check_block_range("block_mapping", id_range, kv_cache.shape[1], f"kv_caches[{layer}]")
    on_device: dict[torch.device, Tensor] = {}
    for kv_cache in kv_caches:
        if kv_cache.device not in on_device:
            on_device[kv_cache.device] = block_mapping.to(kv_cache.device)
        mapping = on_device[kv_cache.device]
        kv_cache[:, mapping[:, 1]] = kv_cache[:, mapping[:, 0]]


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
    """Copy block ``src_id`` of ``src`` into block ``dst_id`` of ``dst`` (every plane) for each
    row ``(src_id, dst_id)`` of ``block_mapping``; one layer, caches possibly on different
    devices (device cache <-> CPU swap space)."""
    check_kv_cache("src", src)
    check_kv_cache("dst", dst)
    if src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
        raise ValueError(
            f"dst has shape {list(dst.shape)} but src has {list(src.shape)}; they may differ "
            "only in num_blocks (dim 1)"
        )
    if src.dtype != dst.dtype:
        raise ValueError(f"dst has dtype {dst.dtype} but src has {src.dtype}")
    check_block_mapping(block_mapping)
    _check_block_range("block_mapping[:, 0]", _id_range(block_mapping[:, 0]), src.shape[1], "src")
    _check_block_range("block_mapping[:, 1]", _id_range(block_mapping[:, 1]), dst.shape[1], "dst")
    src_ids = block_mapping[:, 0].to(src.device)
    dst_ids = block_mapping[:, 1].to(dst.device)
    dst[:, dst_ids] = src[:, src_ids].to(dst.device)


def _attend_decode_group(
    query: Tensor,
    kv_cache: Tensor,
    group: DecodeGroup,
    scale: float,
    soft_cap: float | None,
    sinks: Tensor | None,
    workspace: GatherWorkspace,
    dequant: KVDequant,
    out: Tensor,
) -> None:
    planes, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    value_dim = out.shape[-1]
    # One query row per request, so the G = num_heads // num_kv_heads query heads that share a
    # kv head can stand in for SDPA's query-length dim: q[b, kv_head, g] attends over
    # k[b, kv_head] with the same key mask for every g. That is GQA with no kv expansion.
    q = query.index_select(0, group.token_rows).view(
        group.num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim
    )
    kv = _gather_kv(kv_cache, group.block_ids, workspace, dequant).view(
        planes, group.num_seqs, group.max_blocks * block_size, num_kv_heads, head_dim
    )
    k, v = kv[0].transpose(1, 2), kv[-1, ..., :value_dim].transpose(1, 2)
    if soft_cap is None and sinks is None:
        o = F.scaled_dot_product_attention(
            q.to(kv.dtype), k, v, attn_mask=group.key_mask, scale=scale
        )
    else:
        # Each request's G query heads are the [G, 1] (heads, tokens) of one kv head.
        o = _explicit_attention(
            q.unsqueeze(3), k, v, group.key_mask.unsqueeze(1), scale, soft_cap, sinks
        )
    out.index_copy_(0, group.token_rows, o.reshape(group.num_seqs, num_heads, value_dim).to(out))


def _attend_prefill_chunk(
    query: Tensor,
    kv_cache: Tensor,
    chunk: PrefillChunk,
    scale: float,
    window: int | None,
    soft_cap: float | None,
    sinks: Tensor | None,
    workspace: GatherWorkspace,
    dequant: KVDequant,
    out: Tensor,
) -> None:
    planes, _, _, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    query_len = chunk.token_end - chunk.token_start
    q = query[chunk.token_start : chunk.token_end].transpose(0, 1).unsqueeze(0)
    kv = _gather_kv(kv_cache, chunk.block_ids, workspace, dequant).view(
        planes, -1, num_kv_heads, head_dim
    )
    num_keys = chunk.seq_len - chunk.key_start
    k = kv[0, :num_keys].transpose(0, 1).unsqueeze(0)
    v = kv[-1, :num_keys, :, : out.shape[-1]].transpose(0, 1).unsqueeze(0)
    if soft_cap is not None or sinks is not None:
        group_q = q.view(1, num_kv_heads, num_heads // num_kv_heads, query_len, head_dim)
        mask = _chunk_key_mask(chunk, window, q.device)
        o = _explicit_attention(group_q, k, v, mask, scale, soft_cap, sinks).view(
            *q.shape[:-1], v.shape[-1]
        )
    elif window is None:
        # The queries are the *last* query_len of seq_len positions, so the causal diagonal is
        # anchored bottom-right (query i sees keys <= seq_len - query_len + i); SDPA's
        # is_causal anchors it top-left, which is only right when the chunk starts at 0.
        o = F.scaled_dot_product_attention(
            q.to(k.dtype),
            k,
            v,
            attn_mask=_bottom_right_causal_mask(query_len, chunk.seq_len, q.device),
            scale=scale,
            is_causal=query_len == chunk.seq_len,
            enable_gqa=num_heads != num_kv_heads,
        )
    else:
        o = F.scaled_dot_product_attention(
            q.to(k.dtype),
            k,
            v,
            attn_mask=_chunk_key_mask(chunk, window, q.device),
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
    out[chunk.token_start : chunk.token_end] = o[0].transpose(0, 1)


def _chunk_key_mask(chunk: PrefillChunk, window: int | None, device: torch.device) -> Tensor:
    """bool ``[query_len, seq_len - key_start]``: whether the chunk's query ``i`` (at position
    ``q = seq_len - query_len + i``) sees the gathered key at position ``k``: ``k <= q`` and,
    with a window, ``k > q - window``."""
    query_len = chunk.token_end - chunk.token_start
    q_pos = torch.arange(chunk.seq_len - query_len, chunk.seq_len, device=device)[:, None]
    k_pos = torch.arange(chunk.key_start, chunk.seq_len, device=device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return visible


def _explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    scale: float,
    soft_cap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """Attention as matmul / mask / softmax / matmul in float32, for what SDPA has no hook for:
    scores soft-capped, ``cap * tanh(scale * q.k / cap)``, and attention sinks.

    ``q`` ``[B, num_kv_heads, G, query_len, head_dim]`` (the G query heads sharing a kv head),
    ``k`` ``[B, num_kv_heads, num_keys, head_dim]``, ``v`` ``[..., num_keys, v_head_dim]``,
    ``mask`` bool broadcastable to ``[B, num_kv_heads, G, query_len, num_keys]`` and True where a
    key is visible (every query sees at least one), ``sinks`` float32 ``[num_kv_heads * G]``.
    Returns float32 ``[B, num_kv_heads, G, query_len, v_head_dim]``.

    Sinked calls come here rather than rescaling SDPA's output by the ratio of denominators:
    SDPA returns no log-sum-exp, and computing it costs this route's score matmul on top of
    SDPA's own, for the same float32 result.
    """
    batch, num_kv_heads, group, query_len, head_dim = q.shape
    k32, v32 = k.to(torch.float32), v.to(torch.float32)
    sink = None if sinks is None else sinks.view(1, num_kv_heads, group, 1, 1)
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
    # Slices of query rows bound the float32 scores a long prefill chunk materializes.
    scores_per_row = batch * num_kv_heads * group * k.shape[2]
    rows = max(_EXPLICIT_MAX_SCORES // max(scores_per_row, 1), 1)
    for start in range(0, query_len, rows):
        end = min(start + rows, query_len)
        q32 = q[:, :, :, start:end].to(torch.float32).reshape(batch, num_kv_heads, -1, head_dim)
        scores = torch.matmul(q32, k32.transpose(-1, -2))
        scores = scores.view(batch, num_kv_heads, group, end - start, -1)
        if soft_cap is None:
            scores.mul_(scale)
        else:
            scores.mul_(scale / soft_cap).tanh_().mul_(soft_cap)
        row_mask = mask if mask.shape[-2] == 1 else mask[..., start:end, :]
        scores.masked_fill_(~row_mask, float("-inf"))
        probs = _softmax_with_sink(scores, sink).view(batch, num_kv_heads, -1, k.shape[2])
        out[:, :, :, start:end] = torch.matmul(probs, v32).view(out[:, :, :, start:end].shape)
    return out


def _softmax_with_sink(scores: Tensor, sink: Tensor | None) -> Tensor:
    """Softmax over the last dim of float32 ``scores`` (in place), with ``sink`` (broadcast to
    ``scores[..., :1]``) as one more logit in the denominator whose probability is dropped::

        out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m)),  m = max(s_j, sink)
    """
    if sink is None:
        return torch.softmax(scores, dim=-1)
    row_max = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    probs = scores.sub_(row_max).exp_()
    denominator = probs.sum(dim=-1, keepdim=True).add_(torch.exp(sink - row_max))
    return probs.div_(denominator)


def _bottom_right_causal_mask(query_len: int, seq_len: int, device: torch.device) -> Tensor | None:
    """The causal mask of the last ``query_len`` of ``seq_len`` positions (query i sees keys
    ``<= seq_len - query_len + i``); None when they are all of them (SDPA's ``is_causal``). Built
    here rather than with ``torch.nn.attention.bias.causal_lower_right``, whose import pulls in
    torch._dynamo: ~1 s more start-up for every process that imports the engine."""
    if query_len == seq_len:
        return None
    mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=device)
    return mask.tril_(seq_len - query_len)


@dataclass(frozen=True)
class KVDequant:
    """How an FP8 cache's gathered blocks become compute values: ``dtype`` is the query's
    (the model's compute dtype); None for a cache stored in that dtype already."""

    dtype: torch.dtype
    k_scale: float
    v_scale: float

    @classmethod
    def of(
        cls, query: Tensor, kv_cache: Tensor, k_scale: float, v_scale: float
    ) -> KVDequant | None:
        if not is_fp8(kv_cache):
            return None
        return cls(
            query.dtype, check_kv_scale("k_scale", k_scale), check_kv_scale("v_scale", v_scale)
        )


def _gather_kv(
    kv_cache: Tensor, block_ids: Tensor, workspace: GatherWorkspace, dequant: KVDequant | None
) -> Tensor:
    """Every plane (K and V, or the one latent) of ``block_ids``, in the SDPA dtype
    (``sdpa_dtype``) ``[planes, len(block_ids), block_size, num_kv_heads, head_dim]`` (a
    workspace view). An FP8 cache's blocks are gathered as bytes and dequantized into
    ``dequant.dtype``."""
    planes = kv_cache.shape[0]
    shape = (planes, block_ids.numel(), *kv_cache.shape[2:])
    storage = as_storage(kv_cache)
    gathered = workspace.take("gather", shape, storage.dtype, kv_cache.device)
    for i in range(planes):
        torch.index_select(storage[i], 0, block_ids, out=gathered[i])
    if dequant is not None:
        fp8 = gathered.view(kv_cache.dtype)
        values = workspace.take("dequant", shape, dequant.dtype, kv_cache.device)
        for i, kv_scale in enumerate((dequant.k_scale, dequant.v_scale)[:planes]):
            dequantize_kv(fp8[i], kv_scale, dequant.dtype, out=values[i])
        gathered = values
    dtype = sdpa_dtype(gathered.dtype, kv_cache.device)
    if dtype == gathered.dtype:
        return gathered
    return workspace.take("fp32", shape, dtype, kv_cache.device).copy_(gathered)


def sdpa_dtype(kv_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the torch path attends K/V of ``kv_dtype`` (the cache's, or its dequantized
    dtype) in: float32 for float32, bf16 for bf16 on a CPU with native bf16 (AVX512-BF16 or AMX),
    whose SDPA kernel accumulates in float32 (it rounds the probabilities to bf16 for the product
    with V, as flash attention does on GPUs) and is faster there than converting K/V first
    (BENCHMARKS.md); float32 for every other cache (fp16, or bf16 where bf16 is emulated)."""
    if kv_dtype == torch.bfloat16 and device.type == "cpu" and _native_cpu_bf16():
        return torch.bfloat16
    return torch.float32


@functools.cache
def _native_cpu_bf16() -> bool:
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


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
) -> tuple[PrefillChunk, ...]:
    return tuple(
        PrefillChunk(
            token_start=int(query_start_loc[b]),
            token_end=int(query_start_loc[b + 1]),
            seq_len=int(seq_lens[b]),
            block_ids=_to_device(
                block_table[b, : -(-int(seq_lens[b]) // block_size)], torch.int64, device
            ),
        )
        for b in np.flatnonzero(query_lens > 1)
    )


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


def check_kv_cache(name: str, kv_cache: Tensor) -> None:
    """A KV cache tensor: [2, num_blocks, block_size, num_kv_heads, head_dim] (K, V) or
    [1, ...] (a latent), float, contiguous."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] not in (1, 2):
        raise ValueError(
            f"{name} must have shape [2, num_blocks, block_size, num_kv_heads, head_dim] "
            f"(or [1, ...] for a latent cache), got {list(kv_cache.shape)}"
        )
    if not kv_cache.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {kv_cache.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous (slots are addressed through a flat view)")


def _check_same_device_dtype(name: str, t: Tensor, kv_cache: Tensor, fp8_ok: bool = False) -> None:
    """Same dtype as the cache, or (``fp8_ok``) any compute dtype over an FP8 cache."""
    if fp8_ok and is_fp8(kv_cache):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"{name} must be float16, bfloat16 or float32 over an fp8 kv_cache, got {t.dtype}"
            )
    elif t.dtype != kv_cache.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but kv_cache has {kv_cache.dtype}")
    if t.device != kv_cache.device:
        raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")


def check_block_mapping(block_mapping: Tensor) -> None:
    """A [K, 2] int64 tensor of (src, dst) block ids, as copy_blocks and swap_blocks take."""
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(
            f"block_mapping must have shape [K, 2] of (src, dst), got {list(block_mapping.shape)}"
        )
    if block_mapping.dtype != torch.int64:
        raise ValueError(f"block_mapping must be int64, got {block_mapping.dtype}")


def _id_range(block_ids: Tensor) -> tuple[int, int] | None:
    # An out-of-range id would be a device-side assert on GPU; one tiny host sync per call is
    # cheaper to debug, and these copies run once per step, not per layer.
    if block_ids.numel() == 0:
        return None
    return int(block_ids.min()), int(block_ids.max())


def _check_block_range(
    name: str, id_range: tuple[int, int] | None, num_blocks: int, cache_name: str
) -> None:
    if id_range is not None and (id_range[0] < 0 or id_range[1] >= num_blocks):
        raise ValueError(
            f"{name} must be in [0, {num_blocks}) for {cache_name}, "
            f"got values in [{id_range[0]}, {id_range[1]}]"
        )
