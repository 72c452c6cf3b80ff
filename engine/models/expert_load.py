"""Expert load of a mixture-of-experts model: how many tokens each sparse layer's router sent to
each expert, counted on the device so the forward pass never waits on the host for it.

    tokens  int64 [num_hidden_layers, num_experts]   (global layer index; dense layers and other
                                                      pipeline stages' layers stay 0)
    layer l's router: topk_ids [T, top_k] ─ index_add_ ─▶ tokens[l]   (in place: no host sync,
                                                                      and capturable in a graph)
    stats snapshot (about once a second): tokens[sparse layers].tolist() — one copy to the host

A token counts once for each of its top-k experts, so a sparse layer's row sums to
``computed tokens x top_k``. Only one rank per pipeline stage counts (TP rank 0): every rank of
a TP group routes the same tokens the same way, expert parallelism included, since the router
is replicated and runs before the dispatch. The padding rows of a decode bucket (CUDA graphs,
``engine.worker.cuda_graphs``: ``seq_lens`` 0) are not counted.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.models.moe import MoECausalLM, SparseMoeBlock
from llm_kernels.attention_metadata import AttentionMetadata

_SPARSE_BLOCK_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp$")


class ExpertLoadCounter:
    """``tokens[layer, expert]``: (token, expert) routings since the last :meth:`reset`."""

    def __init__(
        self, num_layers: int, num_experts: int, sparse_layers: list[int], device: torch.device
    ) -> None:
        self.tokens = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.sparse_layers = sorted(sparse_layers)
        # Per row of this forward pass: 1 counts, 0 is a decode bucket's padding; None: all count.
        self._row_weights: torch.Tensor | None = None

    def begin_forward(self, metadata: AttentionMetadata) -> None:
        """Called by the model before its layers run (inside a captured graph, too, so each
        replay recomputes the mask from the bucket's ``seq_lens``)."""
        decode_shaped = metadata.max_query_len == 1 and metadata.num_tokens == metadata.num_seqs
        self._row_weights = (metadata.seq_lens > 0).to(torch.int64) if decode_shaped else None

    def add(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count one sparse layer's routing: ``topk_ids`` ``[T, top_k]``."""
        flat = topk_ids.reshape(-1)
        weights = self._row_weights
        if weights is None or weights.shape[0] != topk_ids.shape[0]:
            counts = torch.ones_like(flat)
        else:
            counts = weights.unsqueeze(1).expand(-1, topk_ids.shape[1]).reshape(-1)
        self.tokens[layer].index_add_(0, flat, counts)

    def read(self) -> dict[int, list[int]]:
        """``{sparse layer: tokens per expert}`` (one device-to-host copy)."""
        rows = self.tokens[self.sparse_layers].tolist() if self.sparse_layers else []
        return dict(zip(self.sparse_layers, rows, strict=True))

    def reset(self) -> None:
        self.tokens.zero_()


def attach_expert_load(model: nn.Module, device: torch.device) -> ExpertLoadCounter | None:
    """Give every sparse layer of ``model`` (an :class:`MoECausalLM`) a row of one new
    counter; None (nothing attached) for a model without sparse layers."""
    if not isinstance(model, MoECausalLM):
        return None
    blocks: dict[int, SparseMoeBlock] = {}
    for name, module in model.named_modules():
        match = _SPARSE_BLOCK_NAME.search(name)
        if match is not None and isinstance(module, SparseMoeBlock):
            blocks[int(match[1])] = module
    if not blocks:
        return None
    num_layers = max(int(model.hf["num_hidden_layers"]), max(blocks) + 1)
    num_experts = max(block.num_experts for block in blocks.values())
    counter = ExpertLoadCounter(num_layers, num_experts, list(blocks), device)
    for layer, block in blocks.items():
        block.expert_load = (counter, layer)
    model.expert_load = counter
    return counter


__all__ = ["ExpertLoadCounter", "attach_expert_load"]
