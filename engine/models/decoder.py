"""The decoder-only transformer every family composes: attention, gated MLP, the layer stack
with its pipeline-stage split (``engine.pp_partition``), and the causal-LM head — each written
once against the parallel layers, with a family's quirks as constructor arguments.

    Attention   qkv_proj (fused) ─ [q_norm, k_norm per head] ─ rotary ─ PagedAttention ─ o_proj
                knobs: head_dim, biases, qk-norm, scale, sliding window, logit soft-cap
    GatedMLP    gate_up_proj (fused) ─ act(gate) * up ─ down_proj          (SiLU or GELU-tanh)
    DecoderModel  [embed (× embed_scale)] ─ layers[start:end) ─ [final norm]   (one PP stage)
    CausalLM    DecoderModel + LM head (tied or not, optional final logit soft-cap)

A decoder layer maps ``(positions, hidden, residual, metadata)`` to ``(hidden, residual)``; the
residual stream is ``hidden + residual`` (``hidden`` alone while ``residual`` is None), which is
what a pipeline stage hands to the next. The same code runs TP = 1 and TP > 1; with PP each
stage builds only its layers (keyed by their global index, so parameter names match the
checkpoint), stage 0 the embedding and the last stage the final norm and LM head.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from engine import hf_config
from engine.models.layers import PagedAttention, RMSNorm, default_ops
from engine.models.rotary import RopeCache, RotaryEmbedding
from engine.pp_partition import layer_partition, stage_layer_range
from engine.rope_config import rope_head_dim, rope_max_positions, rope_parameters
from llm_kernels.attention_metadata import AttentionMetadata
from llm_kernels.backend import KernelOps
from parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from parallel.state import ParallelContext


def head_dim(hf: dict[str, Any]) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


class Attention(nn.Module):
    """Self-attention over the paged KV cache; heads split across the TP group."""

    def __init__(
        self,
        hf: dict[str, Any],
        ctx: ParallelContext,
        ops: KernelOps,
        rotary: RotaryEmbedding,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: Callable[[int], nn.Module] | None = None,
        scale: float | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        num_heads = hf["num_attention_heads"]
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
        self.head_dim = head_dim(hf)
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, num_heads, num_kv_heads, bias=qkv_bias, tp=ctx.tp
        )
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=o_bias, tp=ctx.tp)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.q_norm = qk_norm(self.head_dim) if qk_norm is not None else None
        self.k_norm = qk_norm(self.head_dim) if qk_norm is not None else None
        # Shared with every layer of the same rope (one cos/sin table per model and rope).
        self.rotary = rotary
        self.attn = PagedAttention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            self.head_dim,
            ops,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.attn.num_heads, self.head_dim)
        k = k.reshape(-1, self.attn.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.attn.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # Per-head RMSNorm over head_dim (Qwen3, Gemma 3), on rows of one head each.
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, metadata)
        return self.o_proj(out.reshape(-1, self.q_size))


def act_and_mul(hf: dict[str, Any], ops: KernelOps) -> Callable[[torch.Tensor], torch.Tensor]:
    """``act(gate) * up`` of the config's activation, for ``x = [gate | up]``."""
    act = hf_config.hidden_activation(hf)
    if act == "silu":
        return ops.silu_and_mul
    if act == "gelu_pytorch_tanh":
        return ops.gelu_tanh_and_mul
    supported = ", ".join(hf_config.SUPPORTED_ACTIVATIONS)
    raise ValueError(f"hidden_act: {act!r} is not supported ({supported})")


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one column-parallel matmul;
    ``intermediate_size`` overrides the config's (an MoE model's dense layers and shared
    expert), ``reduce_results=False`` leaves the output a partial sum (see RowParallelLinear)."""

    def __init__(
        self,
        hf: dict[str, Any],
        ctx: ParallelContext,
        ops: KernelOps,
        *,
        bias: bool = False,
        intermediate_size: int | None = None,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        inter = intermediate_size if intermediate_size is not None else hf["intermediate_size"]
        self.act_and_mul = act_and_mul(hf, ops)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=bias, tp=ctx.tp)
        self.down_proj = RowParallelLinear(
            inter, hidden, bias=bias, tp=ctx.tp, reduce_results=reduce_results
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderModel(nn.Module):
    """This pipeline stage's slice of the decoder: ``make_layer(i)`` builds global layer ``i``,
    ``make_norm(hidden_size)`` the final norm; ``embed_scale`` multiplies the embeddings
    (Gemma's sqrt(hidden_size), in the model dtype as HF rounds it)."""

    def __init__(
        self,
        hf: dict[str, Any],
        ctx: ParallelContext,
        make_layer: Callable[[int], nn.Module],
        make_norm: Callable[[int], nn.Module],
        embed_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        partition = layer_partition(hf, ctx.pp.size, ctx.layer_partition)
        self.start_layer, self.end_layer = stage_layer_range(partition, ctx.pp.rank)
        self.embed_tokens = (
            VocabParallelEmbedding(hf["vocab_size"], hf["hidden_size"], tp=ctx.tp)
            if ctx.pp.is_first
            else None
        )
        self.embed_scale = embed_scale
        self.layers = nn.ModuleDict(
            {str(i): make_layer(i) for i in range(self.start_layer, self.end_layer)}
        )
        self.norm = make_norm(hf["hidden_size"]) if ctx.pp.is_last else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage 0 embeds ``input_ids`` (or takes ``inputs_embeds``, a multimodal model's
        merged text and image embeddings, as they are); later stages continue from (hidden,
        residual). The last stage returns (normed hidden, None)."""
        if inputs_embeds is not None:
            hidden, residual = inputs_embeds, None
        elif self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:
                hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        for layer in self.layers.values():
            hidden, residual = layer(positions, hidden, residual, metadata)
        if self.norm is not None:
            if residual is None:
                return self.norm(hidden), None
            hidden, _ = self.norm(hidden, residual)
            return hidden, None
        return hidden, residual

    def attention_layers(self) -> list[PagedAttention]:
        """Each layer's paged attention (``self_attn.attn``: ``Attention``'s or
        ``MLAAttention``'s), in layer order."""
        return [layer.self_attn.attn for layer in self.layers.values()]


class CausalLM(nn.Module, ABC):
    """Base of every family: ``self.model`` (a :class:`DecoderModel`) plus the LM head.

    A family sets ``packed_modules_mapping`` (HF checkpoint name -> our fused parameter and
    part; see the loader) and builds ``self.model`` in ``build_model``."""

    # HF's default when config.json leaves tie_word_embeddings out (True for Gemma).
    tie_word_embeddings_default: ClassVar[bool] = False
    # False for a pooling head's model (engine.models.pooling_heads): no LM head is built.
    has_lm_head: ClassVar[bool] = True
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps | None = None
    ) -> None:
        super().__init__()
        self.hf = hf
        self.ctx = ctx
        # The kernel backend, fixed for this model's lifetime (torch unless the loader says).
        self.kernel_ops = default_ops(ops)
        self.rope_cache = RopeCache()
        self.layer_types = hf_config.layer_types(hf)
        self.model = self.build_model(hf, ctx, self.kernel_ops)
        self.tie_word_embeddings = bool(
            hf.get("tie_word_embeddings", self.tie_word_embeddings_default)
        )
        self.final_logit_softcapping: float | None = hf.get("final_logit_softcapping")
        self.lm_head = (
            ParallelLMHead(hf["vocab_size"], hf["hidden_size"], tp=ctx.tp)
            if ctx.pp.is_last and self.has_lm_head
            else None
        )
        if (
            self.lm_head is not None
            and self.tie_word_embeddings
            and self.model.embed_tokens is not None
        ):
            self.lm_head.weight = self.model.embed_tokens.weight

    @abstractmethod
    def build_model(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> nn.Module:
        """This family's :class:`DecoderModel` for this pipeline stage."""

    def rotary(self, layer: int) -> RotaryEmbedding:
        """The (shared) rotary embedding of decoder layer ``layer``'s attention type."""
        hf = self.hf
        params = rope_parameters(hf, self.layer_types[layer])
        dim = rope_head_dim(hf) or head_dim(hf)
        return self.rope_cache.get(dim, rope_max_positions(hf), params, self.kernel_ops)

    def sliding_window(self, layer: int) -> int | None:
        return hf_config.layer_window(self.hf, self.layer_types[layer])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model(input_ids, positions, metadata, hidden, residual, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits on TP rank 0 of the last stage (None on other TP ranks)."""
        if self.lm_head is None:
            raise RuntimeError("compute_logits called on a model or stage without the LM head")
        logits = self.lm_head.compute_logits(hidden)
        cap = self.final_logit_softcapping
        if logits is not None and cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

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


class PreNormDecoderLayer(nn.Module):
    """Llama's layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, the residual add fused
    into the next norm."""

    def __init__(self, self_attn: Attention, mlp: nn.Module, make_norm: Callable[[], nn.Module]):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = make_norm()
        self.post_attention_layernorm = make_norm()

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


def rms_norm_factory(hf: dict[str, Any], ops: KernelOps) -> Callable[..., RMSNorm]:
    eps = hf.get("rms_norm_eps", 1e-6)
    return lambda size=hf["hidden_size"]: RMSNorm(size, eps, ops)
