"""Llama-family decoder (Llama, Mistral, Qwen2), written once against the parallel layers.

The same code runs TP = 1 and TP > 1; with PP each stage builds only its decoder layers
(keyed by their global index, so parameter names match the checkpoint), stage 0 the embedding
and the last stage the final norm and LM head. Qwen2 differs only by qkv bias and tied
embeddings, both read from the HF config.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from engine.models.layers import PagedAttention, RMSNorm, RotaryEmbedding, default_ops
from kernels.attention import AttentionMetadata
from kernels.backend import KernelOps
from parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from parallel.state import ParallelContext


def pp_layer_range(
    num_layers: int, pp_rank: int, pp_size: int, partition: tuple[int, ...] | None = None
) -> tuple[int, int]:
    """Decoder layers [start, end) of stage ``pp_rank``: ``partition`` (layers per stage) when
    given, else an even split where earlier stages take the remainder."""
    if partition is not None:
        start = sum(partition[:pp_rank])
        return start, start + partition[pp_rank]
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class LlamaAttention(nn.Module):
    def __init__(
        self, hf: dict[str, Any], ctx: ParallelContext, qkv_bias: bool, ops: KernelOps
    ) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        num_heads = hf["num_attention_heads"]
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
        head_dim = hf.get("head_dim") or hidden // num_heads
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, num_heads, num_kv_heads, bias=qkv_bias, tp=ctx.tp
        )
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=False, tp=ctx.tp)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        base = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        self.rotary = RotaryEmbedding(head_dim, hf["max_position_embeddings"], base, rope, ops)
        self.attn = PagedAttention(
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, ops
        )
        self.head_dim = head_dim

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.attn.num_heads, self.head_dim)
        k = k.view(-1, self.attn.num_kv_heads, self.head_dim)
        v = v.view(-1, self.attn.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, metadata)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        hidden, inter = hf["hidden_size"], hf["intermediate_size"]
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], tp=ctx.tp)
        self.down_proj = RowParallelLinear(inter, hidden, tp=ctx.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, hf: dict[str, Any], ctx: ParallelContext, qkv_bias: bool, ops: KernelOps
    ) -> None:
        super().__init__()
        eps = hf.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(hf, ctx, qkv_bias, ops)
        self.mlp = LlamaMLP(hf, ctx, ops)
        self.input_layernorm = RMSNorm(hf["hidden_size"], eps, ops)
        self.post_attention_layernorm = RMSNorm(hf["hidden_size"], eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self, hf: dict[str, Any], ctx: ParallelContext, qkv_bias: bool, ops: KernelOps
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.start_layer, self.end_layer = pp_layer_range(
            hf["num_hidden_layers"], ctx.pp.rank, ctx.pp.size, ctx.layer_partition
        )
        self.embed_tokens = (
            VocabParallelEmbedding(hf["vocab_size"], hf["hidden_size"], tp=ctx.tp)
            if ctx.pp.is_first
            else None
        )
        self.layers = nn.ModuleDict(
            {
                str(i): LlamaDecoderLayer(hf, ctx, qkv_bias, ops)
                for i in range(self.start_layer, self.end_layer)
            }
        )
        eps = hf.get("rms_norm_eps", 1e-6)
        self.norm = RMSNorm(hf["hidden_size"], eps, ops) if ctx.pp.is_last else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage 0 embeds ``input_ids``; later stages continue from (hidden, residual).
        The last stage returns (normed hidden, None)."""
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers.values():
            hidden, residual = layer(positions, hidden, residual, metadata)
        if self.norm is not None:
            hidden, _ = self.norm(hidden, residual)
            return hidden, None
        return hidden, residual

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers.values()]


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name -> (our fused parameter, part); see weight loading in model_loader.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qkv_bias = False

    def __init__(
        self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps | None = None
    ) -> None:
        super().__init__()
        self.hf = hf
        self.ctx = ctx
        # The kernel backend, fixed for this model's lifetime (torch unless the loader says).
        self.kernel_ops = default_ops(ops)
        qkv_bias = self.qkv_bias or bool(hf.get("attention_bias", False))
        self.model = LlamaModel(hf, ctx, qkv_bias, self.kernel_ops)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        self.lm_head = (
            ParallelLMHead(hf["vocab_size"], hf["hidden_size"], tp=ctx.tp)
            if ctx.pp.is_last
            else None
        )
        if (
            self.lm_head is not None
            and self.tie_word_embeddings
            and self.model.embed_tokens is not None
        ):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model(input_ids, positions, metadata, hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits on TP rank 0 of the last stage (None on other TP ranks)."""
        if self.lm_head is None:
            raise RuntimeError("compute_logits called on a pipeline stage without the LM head")
        return self.lm_head.compute_logits(hidden)

    def checkpoint_aliases(self, name: str) -> Iterable[str]:
        """Extra parameter names a checkpoint tensor also loads into (tied LM head on a stage
        that does not hold the embedding)."""
        if (
            name == "model.embed_tokens.weight"
            and self.tie_word_embeddings
            and self.lm_head is not None
            and self.model.embed_tokens is None
        ):
            yield "lm_head.weight"

    def attention_layers(self) -> list[PagedAttention]:
        return self.model.attention_layers()


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
