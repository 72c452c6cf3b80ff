"""PagedAttention in plain torch: the CPU serving path and the reference for the Triton kernels
and the native CPU decode kernel (``llm_kernels.cpu_decode``, which takes over the decode rows
through ``paged_attention``'s ``decode_kernel`` hook). The argument checks every path shares
are ``llm_kernels.attention_checks``, the step metadata and its plans
``llm_kernels.attention_metadata``, FP8 KV quantization ``llm_kernels.kv_quant``.

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

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from llm_kernels.attention_checks import (
    check_attention_args,
    check_attention_options,
    check_block_mapping,
    check_block_range,
    check_cache_write_args,
    check_kv_cache,
    check_sinks,
    check_value_dim,
    id_range,
)
from llm_kernels.attention_metadata import (
    AttentionMetadata,
    AttentionPlan,
    DecodeGroup,
    GatherWorkspace,
    PrefillChunk,
    effective_window,
)
from llm_kernels.kv_quant import as_storage, check_kv_scale, dequantize_kv, is_fp8, quantize_kv

__all__ = [
    "DecodeKernel",
    "copy_blocks",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
]

# The explicit (soft-capped or sinked) route materializes float32 scores; a long prefill chunk is
# attended in slices of query rows so that they stay under this many elements (256 MiB).
_EXPLICIT_MAX_SCORES = 1 << 26


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
    included: HF's convention). A prefill chunk's ``bidirectional`` spans (Gemma 3's images)
    also see their own later keys, the window still applying. ``logits_soft_cap`` C turns the
    scaled scores into ``C * tanh(scores / C)`` before the mask and softmax (Gemma 2). ``sinks``
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


def copy_blocks(kv_caches: Sequence[Tensor], block_mapping: Tensor) -> None:
    """For every layer's cache (of either layout), copy block ``src`` into block ``dst`` for
    each row ``(src, dst)`` of ``block_mapping`` (int64 ``[K, 2]``); used for copy-on-write.

    All copies read the caches as they were before the call (gather, then scatter).
    """
    check_block_mapping(block_mapping)
    ids = id_range(block_mapping)
    for layer, kv_cache in enumerate(kv_caches):
        check_kv_cache(f"kv_caches[{layer}]", kv_cache)
        check_block_range("block_mapping", ids, kv_cache.shape[1], f"kv_caches[{layer}]")
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
    check_block_range("block_mapping[:, 0]", id_range(block_mapping[:, 0]), src.shape[1], "src")
    check_block_range("block_mapping[:, 1]", id_range(block_mapping[:, 1]), dst.shape[1], "dst")
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
    elif window is None and not chunk.bidirectional:
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
    ``q = seq_len - query_len + i``) sees the gathered key at position ``k``: ``k <= q`` or
    both in one of the chunk's ``bidirectional`` spans (HF's OR of causal and blockwise) and,
    with a window, ``k > q - window``."""
    query_len = chunk.token_end - chunk.token_start
    q_pos = torch.arange(chunk.seq_len - query_len, chunk.seq_len, device=device)[:, None]
    k_pos = torch.arange(chunk.key_start, chunk.seq_len, device=device)[None, :]
    visible = k_pos <= q_pos
    for lo, hi in chunk.bidirectional:
        visible |= (q_pos >= lo) & (q_pos < hi) & (k_pos >= lo) & (k_pos < hi)
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
