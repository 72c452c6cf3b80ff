"""``method: draft_model`` on the worker: a smaller model, sharded like the target on the same
ranks, whose KV cache mirrors the target's and which proposes k tokens greedily.

KV: one cache tensor per draft layer, allocated by the model runner in the target's KV cache
group of the layer's window (``engine.core.kv_cache_groups``: full attention, or the same sliding
window), read and written through that group's block tables and slot mapping. Every step the
draft runs over exactly the target's input tokens, positions and slots (prefill chunks,
recomputation after a preemption and verified proposals included), so for every position the
target holds K/V for, the draft does too; rejected positions are overwritten later, as the
target's are. Copies and swaps of blocks apply to both caches.

Proposals: from each request's newly emitted token (at position p) the draft decodes
greedily, one token per forward pass: k passes write K/V at p .. p + k - 1, slots the
scheduler reserved as lookahead (``Scheduler.num_lookahead_tokens``), and give the k argmax
tokens. They are point-mass proposals, like n-gram ones: greedy verification accepts the
target's argmax, and the rejection sampler (accept with probability p_target(token), else
resample from the target's residual) keeps the target's distribution exactly for sampled
requests too. Under TP > 1 the driver's (TP rank 0's) tokens reach the other ranks through one
all-reduce per pass (the others add zeros), since every rank runs every draft pass.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engine.core.kv_cache_groups import KVCacheLayout
from llm_kernels.attention_metadata import AttentionMetadata, build_group_metadata
from parallel.state import ParallelContext


class DraftModel:
    def __init__(
        self,
        model: nn.Module,
        num_speculative_tokens: int,
        device: torch.device,
        ctx: ParallelContext,
        block_size: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.k = num_speculative_tokens
        self.device = device
        self.ctx = ctx
        self.block_size = block_size
        self.max_model_len = max_model_len
        # The draft's layers' caches (set by the model runner, which allocates them).
        self.kv_caches: list[torch.Tensor] = []

    # ---- one step -----------------------------------------------------------------------

    @torch.inference_mode()
    def mirror(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """The target's step over the draft: only its K/V writes are kept."""
        self.model(input_ids, positions, metadata, None, None)

    @torch.inference_mode()
    def propose(
        self,
        req_ids: list[str],
        block_ids: list[list[list[int]]],
        tokens: list[int] | None,
        positions: list[int] | None,
        layout: KVCacheLayout,
    ) -> dict[str, list[int]]:
        """Up to k greedy tokens per request after its newly emitted token ``tokens[i]`` at
        ``positions[i]`` (given on the driver; None on the other TP ranks, which get them
        from the driver). ``block_ids[i]``: request i's block table in each KV cache group of
        ``layout`` (local ids). A request proposes fewer where its reserved slots or
        max_model_len end. Returns the proposals on the driver ({} elsewhere)."""
        if not req_ids:
            return {}
        start = self._share(tokens, positions, len(req_ids))
        current = start[:, 0].copy()
        pos = start[:, 1].copy()
        limits = np.array(
            [min(len(b[0]) * self.block_size, self.max_model_len) for b in block_ids],
            dtype=np.int64,
        )
        tables = []
        for g in range(len(layout.specs)):
            table = np.zeros((len(req_ids), max(len(b[g]) for b in block_ids)), dtype=np.int32)
            for i, b in enumerate(block_ids):
                table[i, : len(b[g])] = b[g]
            tables.append(table)
        proposals: list[list[int]] = [[] for _ in req_ids]
        for _ in range(self.k):
            rows = np.nonzero(pos < limits)[0]
            if len(rows) == 0:
                break
            next_tokens = self._step(current[rows], pos[rows], [t[rows] for t in tables], layout)
            for row, token in zip(rows.tolist(), next_tokens.tolist()):
                proposals[row].append(token)
            current[rows] = next_tokens
            pos[rows] += 1
        if not (self.ctx.tp.is_first and self.ctx.pp.is_last):
            return {}
        return {rid: p for rid, p in zip(req_ids, proposals) if p}

    def _step(
        self, tokens: np.ndarray, pos: np.ndarray, tables: list[np.ndarray], layout: KVCacheLayout
    ) -> np.ndarray:
        """One draft pass: one token per row at ``pos``; its argmax (on every rank)."""
        n = len(tokens)
        meta = build_group_metadata(
            query_lens=np.ones(n, dtype=np.int32),
            seq_lens=(pos + 1).astype(np.int32),
            block_tables=tables,
            windows=layout.windows,
            positions=pos,
            req_index=np.arange(n),
            block_size=self.block_size,
            device=self.device,
        )
        ids = torch.from_numpy(tokens.astype(np.int64)).to(self.device)
        hidden, _ = self.model(ids, torch.from_numpy(pos).to(self.device), meta, None, None)
        logits = self.model.compute_logits(hidden)
        argmax = logits.argmax(dim=-1) if logits is not None else None
        return self._broadcast(argmax, n)

    def _share(self, tokens: list[int] | None, positions: list[int] | None, n: int) -> np.ndarray:
        """(token, position) rows, from the driver to every TP rank."""
        if tokens is not None and positions is not None:
            local = torch.tensor(list(zip(tokens, positions)), dtype=torch.int64)
        else:
            local = None
        if self.ctx.tp.size == 1:
            if local is None:
                raise RuntimeError("draft proposals need the emitted tokens on a lone rank")
            return local.numpy()
        shared = torch.zeros((n, 2), dtype=torch.int64, device=self.device)
        if local is not None:
            shared.copy_(local)
        return self.ctx.tp.all_reduce(shared).cpu().numpy()

    def _broadcast(self, argmax: torch.Tensor | None, n: int) -> np.ndarray:
        if self.ctx.tp.size == 1:
            if argmax is None:
                raise RuntimeError("a lone rank computed no draft logits")
            return argmax.cpu().numpy()
        shared = torch.zeros(n, dtype=torch.int64, device=self.device)
        if argmax is not None:
            shared.copy_(argmax)
        return self.ctx.tp.all_reduce(shared).cpu().numpy()
