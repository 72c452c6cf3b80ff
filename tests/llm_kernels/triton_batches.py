"""Random paged batches shared by the Triton kernel tests: shuffled, non-contiguous blocks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from llm_kernels.attention_metadata import AttentionMetadata


def paged_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    planes: int = 2,
    bidirectional: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(query, kv_cache, metadata) with every request's blocks drawn at random from a pool
    with spare blocks, so physical order never matches logical order; ``planes=1`` draws a
    one-plane latent cache; ``bidirectional``: each request's spans attended both ways."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = rng.permutation(num_blocks)
    block_table = np.zeros((len(seq_lens), max(blocks_per_seq, default=1) + 1), dtype=np.int32)
    taken = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = perm[taken : taken + n]
        taken += n
    shape = (planes, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    num_tokens = int(sum(query_lens))
    query = torch.randn((num_tokens, num_heads, head_dim), generator=gen).to(dtype).to(device)
    metadata = AttentionMetadata.build(
        query_lens=np.asarray(query_lens),
        seq_lens=np.asarray(seq_lens),
        block_table=block_table,
        slot_mapping=np.full(num_tokens, -1),
        block_size=block_size,
        device=torch.device(device),
        bidirectional=bidirectional,
    )
    return query, kv_cache, metadata
