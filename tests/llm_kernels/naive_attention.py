"""A naive paged attention for the kernel tests: float64, one request and one query token at a
time, with the window and the soft cap applied the obvious way. It reads only the inputs
(query, cache, and the metadata's block table, seq_lens and query_start_loc), never the torch
path's plans."""

from __future__ import annotations

import math

import torch

from llm_kernels.attention_metadata import AttentionMetadata


def naive_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    v_head_dim: int | None = None,
    bidirectional: list[list[tuple[int, int]]] | None = None,
) -> torch.Tensor:
    """float64 ``[num_tokens, num_heads, head_dim]``: token ``i`` of a request's chunk, at
    position ``q = seq_len - query_len + i``, attends keys ``q - sliding_window < k <= q``
    (``k <= q`` without a window), with scores ``cap * tanh(scale * q.k / cap)`` when capped.
    A one-plane (latent) cache's values are its keys' first ``v_head_dim`` values, and the
    output is ``[..., v_head_dim]``. ``bidirectional[b]``: position spans of request ``b``
    whose tokens also see each other's later keys (the window still applying)."""
    num_heads = query.shape[1]
    planes, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    value_dim = head_dim if planes == 2 else v_head_dim
    kv_head_of = torch.arange(num_heads) // (num_heads // num_kv_heads)
    out = torch.zeros((*query.shape[:2], value_dim), dtype=torch.float64)
    starts = metadata.query_start_loc.cpu().tolist()
    for b, seq_len in enumerate(metadata.seq_lens.cpu().tolist()):
        blocks = metadata.block_table[b, : math.ceil(seq_len / block_size)].cpu().tolist()
        keys, values = (
            torch.cat([kv_cache[i, blk].cpu() for blk in blocks])[:seq_len].double()
            for i in (0, planes - 1)
        )
        values = values[..., :value_dim]
        query_len = starts[b + 1] - starts[b]
        for i in range(query_len):
            row = starts[b] + i
            position = seq_len - query_len + i
            k_pos = torch.arange(seq_len)
            visible = k_pos <= position
            for lo, hi in bidirectional[b] if bidirectional else ():
                if lo <= position < hi:
                    visible |= (k_pos >= lo) & (k_pos < hi)
            if sliding_window is not None:
                visible &= k_pos > position - sliding_window
            # Only the visible keys take part: nothing else is read, not even times 0.
            k, v = keys[visible][:, kv_head_of], values[visible][:, kv_head_of]
            q = query[row].cpu().double()  # [num_heads, head_dim]
            scores = torch.einsum("thd,hd->ht", k, q) * scale
            if logits_soft_cap is not None:
                scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
            out[row] = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v)
    return out
