"""PagedAttention in Triton: one kernel for a packed batch mixing decode tokens and prefill
chunks, reading K/V through block tables; plus a split-KV (flash-decoding) path. A one-plane
latent cache (multi-head latent attention) goes to ``llm_kernels.triton_mla``. Same contract as
``llm_kernels.attention.paged_attention`` (the torch reference): cache layout, packed query,
causal and sliding-window masks, soft cap before the mask, attention sinks.

Work split. A program owns one *query tile* of one request and one kv head::

    tile rows m = 0 .. BLOCK_M-1      token  = m // G_PAD   (BLOCK_Q tokens of the request)
                                      q head = kv_head * G + m % G_PAD   (the G heads sharing it)

so GQA/MQA reads each K/V tile once for all G query heads, and a decode token (BLOCK_Q = 1)
still fills the BLOCK_M >= 16 rows ``tl.dot`` needs once G_PAD is 16, or pads up to it.
Request ``b``'s tiles are programs ``query_start_loc[b] // BLOCK_Q + b`` onward (one spare id
per request keeps tiles of different requests apart), found by binary search in the kernel:
the grid depends only on ``num_tokens`` and ``num_seqs``, so no host work per step and the
launch is CUDA-graph safe. The program walks its keys in tiles with an online softmax
(``_paged_attention_kernel``); ``num_kv_splits > 1`` cuts them into ranges merged by
``merge_splits_kernel``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from llm_kernels import attention as torch_attention
from llm_kernels.attention_checks import check_attention_args, check_attention_options, check_sinks
from llm_kernels.attention_metadata import AttentionMetadata, effective_window
from llm_kernels.kv_quant import as_storage, check_kv_scale, is_fp8
from llm_kernels.triton_common import (
    ATTENTION_DTYPES,
    LOG2E,
    MAX_KV_SPLITS,
    check_triton_device,
    choose_num_kv_splits,
    dot,
    find_seq,
    interpreter_enabled,
    load_kv,
    merge_splits_kernel,
)
from llm_kernels.triton_mla import paged_latent_attention

__all__ = ["paged_attention"]

# Rows of a tile: tl.dot needs >= 16; 64 keeps prefill tiles efficient without spilling.
_DECODE_BLOCK_M = 16
_PREFILL_BLOCK_M = 64


@triton.jit
def _tanh(x):
    """float32 tanh from exp2 (libdevice's is unavailable under the interpreter). Near 0, where
    ``1 - exp(-2|x|)`` would cancel, its odd Taylor polynomial (error < 1e-9 below 1/8)."""
    a = tl.abs(x)
    e = tl.math.exp2(a * -2.8853900817779268)  # exp(-2|x|)
    far = (1.0 - e) / (1.0 + e)
    a2 = a * a
    near = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 - a2 * 0.05396825)))
    t = tl.where(a < 0.125, near, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    q_ptr,
    kv_ptr,
    sinks_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    num_heads,
    score_scale,
    softcap_log2,
    window,
    k_scale,
    v_scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_kv,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_block_table,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """``score_scale`` is scale * log2(e), or scale / cap with a soft cap, whose scores are then
    ``tanh(.) * softcap_log2`` (cap * log2(e)); ``window`` counts only with HAS_WINDOW. With
    KV_FP8, ``kv_ptr`` is the FP8 cache viewed as bytes, dequantized with k_scale / v_scale.
    With HAS_SINKS, ``sinks_ptr`` is float32 ``[num_heads]``: a sink is a logit per query head
    in the softmax's denominator, with no value, so the online softmax starts from it instead of
    from ``max = -inf, sum = 0``; with split-KV only the first split does, so the merge counts
    it once.

    The program walks its keys in tiles of TILE_N positions (several cache blocks, looked up
    per key row), keeping an online softmax in float32 (base 2). With ``num_kv_splits > 1`` the
    keys are cut into that many ranges, one program each; each writes its normalized partial
    output and log-sum-exp, and ``merge_splits_kernel`` merges them. That is what keeps a GPU
    busy when a few long decodes leave ``num_seqs * num_kv_heads`` programs too few to fill it.

    With a sliding window the walk starts at the first key tile that can be inside the window
    of the program's first (earliest) query, so a windowed layer reads O(W) keys per query tile
    whatever the context length; the splits divide that restricted range::

        positions  0 ....................................... kv_bound
        tiles      |  skipped, below every window  | walked, split NUM_SPLITS ways |
                                                   ^ tile of (first query's position - W + 1)
    """
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_valid = offs_d < HEAD_DIM
    q_pos = tile * BLOCK_Q + offs_m // G_PAD  # position inside this step's chunk
    group = offs_m % G_PAD
    head = kv_head * G + group
    row_valid = (q_pos < query_len) & (group < G)
    token = (q_start + q_pos).to(tl.int64)

    q_offsets = token[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    # Keys this tile can see: up to its last query's position (causal), never past seq_len.
    last_q = tl.minimum((tile + 1) * BLOCK_Q, query_len)
    kv_bound = tl.minimum(context_len + last_q, seq_len)
    num_tiles = tl.cdiv(kv_bound, TILE_N)
    if HAS_WINDOW:
        # The tile's first query has the earliest window: keys before its start are unseen.
        window_start = tl.maximum(context_len + tile * BLOCK_Q - window + 1, 0)
        first_tile = window_start // TILE_N
    else:
        first_tile = 0
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        # The sink as a first logit already seen, exp2(sink - m) = 1 with m = sink (base 2 like
        # the scores); by split 0 only, so that the merge counts it once.
        sink = tl.load(sinks_ptr + head, mask=group < G, other=0.0) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    block_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    for kv_tile in range(tile_lo, tile_hi):
        k_pos = kv_tile * TILE_N + tl.arange(0, TILE_N)
        k_valid = k_pos < kv_bound
        block_id = tl.load(block_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
        kv_offsets = (
            block_id.to(tl.int64) * stride_kv_block
            + (k_pos % BLOCK_SIZE) * stride_kv_slot
            + kv_head * stride_kv_head
        )
        k = load_kv(
            kv_ptr + kv_offsets[None, :] + offs_d[:, None],
            k_valid[None, :] & d_valid[:, None],
            k_scale,
            q.dtype,
            KV_FP8,
        )
        s = dot(q, k, DOT_UPCAST, DOT_PRECISION) * score_scale
        if HAS_SOFTCAP:
            s = _tanh(s) * softcap_log2
        visible = (k_pos[None, :] <= (context_len + q_pos)[:, None]) & k_valid[None, :]
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > (context_len + q_pos - window)[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead keeps
        # exp2 at 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv(
            kv_ptr + stride_kv + kv_offsets[:, None] + offs_d[None, :],
            k_valid[:, None] & d_valid[None, :],
            v_scale,
            q.dtype,
            KV_FP8,
        )
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_UPCAST, DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        out_offsets = (
            token[:, None] * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :]
        )
        tl.store(out_ptr + out_offsets, o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # partial_out [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM], partial_lse [.., NUM_SPLITS]
        row = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=store_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(partial_lse_ptr + row, lse, mask=row_valid)


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
    num_kv_splits: int | None = None,
) -> Tensor:
    """Causal attention of the packed ``query`` ``[num_tokens, num_heads, head_dim]`` over each
    request's paged context; returns a new contiguous tensor shaped and typed like ``query``.
    ``sliding_window``, ``logits_soft_cap`` and ``sinks`` as in
    ``llm_kernels.attention.paged_attention``.

    An FP8 cache is dequantized in the kernel with ``k_scale``/``v_scale`` into
    ``query.dtype``, the same values the torch path attends over. A one-plane latent cache
    (``v_head_dim``) is ``llm_kernels.triton_mla``'s, which has no window, soft cap or sinks.

    ``num_kv_splits`` forces the split-KV path's split count (default: ``choose_num_kv_splits``).

    A step whose prefill chunks hold spans attended both ways (Gemma 3's images:
    ``AttentionMetadata.has_bidirectional``) is attended by the torch path, whose masked
    prefill is exact on any device; these kernels are causal only.
    """
    if metadata.has_bidirectional:
        return torch_attention.paged_attention(
            query, kv_cache, metadata, scale, sliding_window, logits_soft_cap, k_scale, v_scale,
            v_head_dim=v_head_dim, sinks=sinks,
        )  # fmt: skip
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 1:
        check_attention_options(sliding_window, logits_soft_cap)
        if sliding_window is not None or logits_soft_cap is not None or sinks is not None:
            raise ValueError("a latent cache is attended without sliding_window, soft cap or sinks")
        return paged_latent_attention(
            query, kv_cache, metadata, scale, v_head_dim, k_scale, num_kv_splits=num_kv_splits
        )
    if v_head_dim is not None and v_head_dim != kv_cache.shape[-1]:
        raise ValueError(f"v_head_dim is for a one-plane (latent) kv_cache, got {v_head_dim}")
    _check_inputs(query, kv_cache, metadata, scale)
    fp8 = is_fp8(kv_cache)
    if fp8:
        k_scale, v_scale = check_kv_scale("k_scale", k_scale), check_kv_scale("v_scale", v_scale)
    check_attention_options(sliding_window, logits_soft_cap)
    check_sinks(sinks, query)
    window = effective_window(sliding_window, metadata)
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(metadata, kv_cache.shape[3], window)
    if not isinstance(num_kv_splits, int) or not 1 <= num_kv_splits <= MAX_KV_SPLITS:
        raise ValueError(
            f"num_kv_splits must be an int in [1, {MAX_KV_SPLITS}], got {num_kv_splits!r}"
        )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if metadata.num_tokens == 0:
        return out
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(_DECODE_BLOCK_M if metadata.max_query_len == 1 else _PREFILL_BLOCK_M, group_pad)
    block_q = block_m // group_pad
    d_pad = max(triton.next_power_of_2(head_dim), 16)
    # Register budget: a 256-wide head takes half the keys per tile.
    tile_n = max(block_size, 32 if d_pad > 128 else 64)
    partial_out = partial_lse = out  # unused placeholders when there is one split
    if num_kv_splits > 1:
        partial_out = torch.empty(
            (metadata.num_tokens, num_heads, num_kv_splits, head_dim),
            dtype=torch.float32,
            device=query.device,
        )
        partial_lse = torch.empty(
            (metadata.num_tokens, num_heads, num_kv_splits),
            dtype=torch.float32,
            device=query.device,
        )
    if logits_soft_cap is None:
        score_scale, softcap_log2 = scale * LOG2E, 0.0
    else:
        score_scale, softcap_log2 = scale / logits_soft_cap, logits_soft_cap * LOG2E
    grid = (metadata.num_tokens // block_q + metadata.num_seqs, num_kv_heads, num_kv_splits)
    _paged_attention_kernel[grid](
        out,
        partial_out,
        partial_lse,
        query,
        as_storage(kv_cache),
        out if sinks is None else sinks.to(torch.float32).contiguous(),  # placeholder if none
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.num_seqs,
        num_heads,
        score_scale,
        softcap_log2,
        0 if window is None else window,
        float(k_scale) if fp8 else 1.0,
        float(v_scale) if fp8 else 1.0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        metadata.block_table.stride(0),
        G=group,
        G_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_kv_splits,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=logits_soft_cap is not None,
        HAS_SINKS=sinks is not None,
        # fp32 caches are meant to match the fp32 reference, so no TF32 rounding.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_UPCAST=query.dtype == torch.bfloat16 and interpreter_enabled(),
        KV_FP8=fp8,
        num_warps=4,
        num_stages=2,
    )
    if num_kv_splits > 1:
        merge_splits_kernel[(metadata.num_tokens, num_heads)](
            out,
            partial_out,
            partial_lse,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=num_kv_splits,
            SPLITS_PAD=max(triton.next_power_of_2(num_kv_splits), 2),
        )
    return out


def _check_inputs(
    query: Tensor, kv_cache: Tensor, metadata: AttentionMetadata, scale: float
) -> None:
    check_attention_args(query, kv_cache, metadata, scale)
    # What the Triton kernel needs beyond the shared checks.
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if kv_cache.dtype not in ATTENTION_DTYPES:
        raise ValueError(
            f"kv_cache dtype must be float16, bfloat16, float32 or float8_e4m3fn, "
            f"got {kv_cache.dtype}"
        )
    if query.stride(2) != 1:
        raise ValueError(
            f"query must have a contiguous last dim, got strides {list(query.stride())}"
        )
    if kv_cache.shape[-1] > 256:
        raise ValueError(f"head_dim must be <= 256, got {kv_cache.shape[-1]}")
    check_triton_device(kv_cache.device, "kv_cache")
