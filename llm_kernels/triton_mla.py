"""Multi-head latent attention in Triton: paged attention over a one-plane latent cache, every
head reading the same cached vector per token (MQA), all of it as the key and its first
``v_head_dim`` values as the value (``engine.models.mla``: DeepSeek's 512-value latent and
64-value rope key, the query already absorbed into that space).

Same contract as ``llm_kernels.attention.paged_attention`` over a latent cache (the torch
reference): cache ``[1, num_blocks, block_size, 1, head_dim]``, query ``[num_tokens,
num_heads, head_dim]`` packed by ``query_start_loc``, causal inside a request's chunk;
returns ``[num_tokens, num_heads, v_head_dim]``. No sliding window or soft cap (MLA has none).
An FP8 cache is dequantized in the kernel with ``k_scale``.

Work split. A program owns one tile of one request's queries and a tile of its heads::

    tile rows m = 0 .. BLOCK_M-1     token = m // BLOCK_H     (BLOCK_Q tokens of the request)
                                     head  = head_tile * BLOCK_H + m % BLOCK_H

so each latent tile read from the cache serves BLOCK_H heads; requests, splits and the grid
work as in ``llm_kernels.triton_attention`` (``_latent_attention_kernel`` has the details).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from llm_kernels.attention_checks import check_attention_args, check_value_dim
from llm_kernels.attention_metadata import AttentionMetadata
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

__all__ = ["paged_latent_attention"]

# Heads per program: the rows of a decode tile (tl.dot needs >= 16).
_BLOCK_H = 16
_PREFILL_BLOCK_M = 64


@triton.jit
def _latent_attention_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    q_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    num_heads,
    score_scale,
    k_scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_block,
    stride_slot,
    stride_block_table,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    V_DIM: tl.constexpr,
    V_PAD: tl.constexpr,
    REST_DIM: tl.constexpr,
    REST_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """``score_scale`` is scale * log2(e). A cache row is ``[V_DIM values | REST_DIM values]``;
    with KV_FP8 ``cache_ptr`` is the FP8 cache viewed as bytes.

    Each latent tile read from the cache serves BLOCK_H heads (a decode token still gives the
    16 rows ``tl.dot`` needs), and the fp32 accumulator stays ``[BLOCK_M, v_head_dim]`` however
    many heads the model has (DeepSeek-V3: 128 per rank at TP 1). The head dim is split into
    the value part (the first ``v_head_dim`` values: the latent) and the rest (the rope key), so
    the score is ``q_lat . k_lat + q_rest . k_rest`` and the value tile is the latent tile
    itself, read once. Requests are found by the same binary search as
    ``llm_kernels.triton_attention`` (programs ``query_start_loc[b] // BLOCK_Q + b`` onward), the
    grid depends only on ``num_tokens`` and ``num_seqs``, and a few long decodes split their
    keys over several programs merged by ``triton_attention``'s merge kernel: CUDA-graph safe,
    no host work per step.
    """
    pid = tl.program_id(0)
    head_tile = tl.program_id(1)
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
    offs_v = tl.arange(0, V_PAD)
    offs_r = tl.arange(0, REST_PAD)
    v_valid = offs_v < V_DIM
    r_valid = offs_r < REST_DIM
    q_pos = tile * BLOCK_Q + offs_m // BLOCK_H  # position inside this step's chunk
    head = head_tile * BLOCK_H + offs_m % BLOCK_H
    row_valid = (q_pos < query_len) & (head < num_heads)
    token = (q_start + q_pos).to(tl.int64)

    q_row = q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head
    q_lat = tl.load(q_row + offs_v[None, :], mask=row_valid[:, None] & v_valid[None, :], other=0.0)
    q_rest = tl.load(
        q_row + V_DIM + offs_r[None, :], mask=row_valid[:, None] & r_valid[None, :], other=0.0
    )

    # Keys this tile can see: up to its last query's position (causal), never past seq_len.
    last_q = tl.minimum((tile + 1) * BLOCK_Q, query_len)
    kv_bound = tl.minimum(context_len + last_q, seq_len)
    num_tiles = tl.cdiv(kv_bound, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_PAD], dtype=tl.float32)
    block_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    for kv_tile in range(tile_lo, tile_hi):
        k_pos = kv_tile * TILE_N + tl.arange(0, TILE_N)
        k_valid = k_pos < kv_bound
        block_id = tl.load(block_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
        rows = block_id.to(tl.int64) * stride_block + (k_pos % BLOCK_SIZE) * stride_slot
        # The latent tile serves as the keys' first part and, transposed, as the values.
        k_lat = load_kv(
            cache_ptr + rows[None, :] + offs_v[:, None],
            k_valid[None, :] & v_valid[:, None],
            k_scale,
            q_lat.dtype,
            KV_FP8,
        )
        k_rest = load_kv(
            cache_ptr + rows[None, :] + V_DIM + offs_r[:, None],
            k_valid[None, :] & r_valid[:, None],
            k_scale,
            q_lat.dtype,
            KV_FP8,
        )
        s = dot(q_lat, k_lat, DOT_UPCAST, DOT_PRECISION)
        s += dot(q_rest, k_rest, DOT_UPCAST, DOT_PRECISION)
        s = s * score_scale
        visible = (k_pos[None, :] <= (context_len + q_pos)[:, None]) & k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead keeps
        # exp2 at 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.trans(k_lat)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_UPCAST, DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & v_valid[None, :]
    if NUM_SPLITS == 1:
        out_offsets = (
            token[:, None] * stride_out_token + head[:, None] * stride_out_head + offs_v[None, :]
        )
        tl.store(out_ptr + out_offsets, o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # partial_out [num_tokens, num_heads, NUM_SPLITS, V_DIM], partial_lse [.., NUM_SPLITS]
        row = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_out_ptr + row[:, None] * V_DIM + offs_v[None, :], o, mask=store_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(partial_lse_ptr + row, lse, mask=row_valid)


def paged_latent_attention(
    query: Tensor,
    cache: Tensor,
    metadata: AttentionMetadata,
    scale: float,
    v_head_dim: int,
    k_scale: float = 1.0,
    *,
    num_kv_splits: int | None = None,
) -> Tensor:
    """Causal attention of ``query`` ``[num_tokens, num_heads, head_dim]`` over the latent
    ``cache`` ``[1, num_blocks, block_size, 1, head_dim]``; returns a new contiguous
    ``[num_tokens, num_heads, v_head_dim]`` in ``query.dtype``. ``num_kv_splits`` forces the
    split-KV path's split count (default: ``triton_common.choose_num_kv_splits``)."""
    check_attention_args(query, cache, metadata, scale)
    value_dim = check_value_dim(cache, v_head_dim)
    if cache.shape[0] != 1 or cache.shape[3] != 1:
        raise ValueError(
            f"cache must be a one-plane latent cache [1, num_blocks, block_size, 1, head_dim], "
            f"got {list(cache.shape)}"
        )
    if cache.dtype not in ATTENTION_DTYPES:
        raise ValueError(f"cache dtype must be float16, bfloat16, float32 or float8_e4m3fn, "
                         f"got {cache.dtype}")  # fmt: skip
    if not cache.is_contiguous() or query.stride(2) != 1:
        raise ValueError("cache must be contiguous and query's last dim contiguous")
    check_triton_device(cache.device, "cache")
    fp8 = is_fp8(cache)
    if fp8:
        k_scale = check_kv_scale("k_scale", k_scale)
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(metadata, 1)
    if not isinstance(num_kv_splits, int) or not 1 <= num_kv_splits <= MAX_KV_SPLITS:
        raise ValueError(
            f"num_kv_splits must be an int in [1, {MAX_KV_SPLITS}], got {num_kv_splits!r}"
        )
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty((num_tokens, num_heads, value_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    block_size = cache.shape[2]
    rest = head_dim - value_dim
    v_pad = max(triton.next_power_of_2(value_dim), 16)
    rest_pad = max(triton.next_power_of_2(max(rest, 1)), 16)
    block_m = _BLOCK_H if metadata.max_query_len == 1 else _PREFILL_BLOCK_M
    block_q = block_m // _BLOCK_H
    # Register budget: DeepSeek's 512-wide latent takes a 32-key tile.
    tile_n = max(block_size, 32 if v_pad > 128 else 64)
    partial_out = partial_lse = out  # unused placeholders when there is one split
    if num_kv_splits > 1:
        partial_out = torch.empty(
            (num_tokens, num_heads, num_kv_splits, value_dim), dtype=torch.float32,
            device=query.device,
        )  # fmt: skip
        partial_lse = torch.empty(
            (num_tokens, num_heads, num_kv_splits), dtype=torch.float32, device=query.device
        )
    grid = (num_tokens // block_q + metadata.num_seqs, triton.cdiv(num_heads, _BLOCK_H),
            num_kv_splits)  # fmt: skip
    _latent_attention_kernel[grid](
        out,
        partial_out,
        partial_lse,
        query,
        as_storage(cache),
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.num_seqs,
        num_heads,
        scale * LOG2E,
        float(k_scale) if fp8 else 1.0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        cache.stride(1),
        cache.stride(2),
        metadata.block_table.stride(0),
        BLOCK_H=_BLOCK_H,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        V_DIM=value_dim,
        V_PAD=v_pad,
        REST_DIM=rest,
        REST_PAD=rest_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_kv_splits,
        # fp32 caches are meant to match the fp32 reference, so no TF32 rounding.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_UPCAST=query.dtype == torch.bfloat16 and interpreter_enabled(),
        KV_FP8=fp8,
        num_warps=8 if v_pad > 128 else 4,
        num_stages=2,
    )
    if num_kv_splits > 1:
        merge_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_lse,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=value_dim,
            D_PAD=v_pad,
            NUM_SPLITS=num_kv_splits,
            SPLITS_PAD=max(triton.next_power_of_2(num_kv_splits), 2),
        )
    return out
