"""engine.models.layers.PagedAttention's attention sinks: none by default, and a model's
``sinks`` parameter handed to the kernels when it sets one."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.models.layers import PagedAttention
from llm_kernels import attention
from llm_kernels.attention_metadata import AttentionMetadata
from llm_kernels.backend import get_kernel_ops

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 16


def attend(layer: PagedAttention) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """One 5-token prompt through ``layer``: its output, the metadata and the filled cache."""
    layer.kv_cache = torch.zeros(2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    metadata = AttentionMetadata.build(
        query_lens=np.array([5]),
        seq_lens=np.array([5]),
        block_table=np.array([[1]]),
        slot_mapping=np.arange(BLOCK_SIZE, BLOCK_SIZE + 5),
        block_size=BLOCK_SIZE,
        device=torch.device("cpu"),
    )
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(5, NUM_HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(5, NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in "kv")
    return layer(q, k, v, metadata), metadata, q


def recording_ops(calls: list[dict[str, Any]]) -> Any:
    """The torch kernels, with the keyword arguments of each paged_attention call recorded."""

    def paged_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs)
        return attention.paged_attention(*args, **kwargs)

    return dataclasses.replace(get_kernel_ops("torch"), paged_attention=paged_attention)


def test_layer_without_sinks_passes_none():
    calls: list[dict[str, Any]] = []
    layer = PagedAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, recording_ops(calls))
    assert layer.sinks is None
    assert "sinks" not in dict(layer.named_parameters())
    attend(layer)
    assert calls == [{}]


def test_layer_passes_its_sinks_parameter_to_the_kernel():
    calls: list[dict[str, Any]] = []
    layer = PagedAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, recording_ops(calls))
    layer.sinks = nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 3.0]), requires_grad=False)
    assert dict(layer.named_parameters())["sinks"] is layer.sinks
    out, metadata, q = attend(layer)
    assert calls[0]["sinks"] is layer.sinks
    expected = attention.paged_attention(
        q, layer.kv_cache, metadata, layer.scale, sinks=layer.sinks
    )
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
