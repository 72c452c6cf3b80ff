"""gpt-oss (``GptOssForCausalLM``): grouped-query attention with q/k/v/o biases and a learned
per-head sink logit in every softmax (``self_attn.sinks``, see ``PagedAttention.sinks``),
sliding-window and full layers as ``layer_types`` alternates them, yarn rope; every layer a
MoE whose router has a bias and picks the top-k logits before a softmax over them, and whose
experts have biases and gpt-oss's clamped SwiGLU. RMSNorm scales in float32 (HF keeps the
norms in float32).

Checkpoints store the experts stacked in HF's layout: ``experts.gate_up_proj``
``[E, H, 2I]`` with gate and up columns interleaved, ``experts.down_proj`` ``[E, I, H]``,
``gate_up_proj_bias`` ``[E, 2I]`` and ``down_proj_bias`` ``[E, H]``; :class:`GptOssExperts`
reads a rank's part of them into the engine's ``[gate; up]`` layout.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import nn

from engine import hf_config
from engine.models.decoder import Attention, DecoderModel, PreNormDecoderLayer
from engine.models.layers import GemmaRMSNorm
from engine.models.moe import MoECausalLM, Routing, SparseMoeBlock
from kernels.backend import KernelOps
from parallel.layers import check_shape
from parallel.moe import ParallelExperts
from parallel.state import ParallelContext

# HF's GptOssConfig default; released configs leave it out.
SWIGLU_ALPHA = 1.702


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of ``x = [gate | up]``: ``(clamp(up, ±limit) + 1) *
    g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``, in x's dtype as HF computes it."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(ParallelExperts):
    """gpt-oss's experts: :class:`ParallelExperts` with projection biases, the clamped
    SwiGLU, and loaders for HF's stacked layout (transposed, gate/up columns interleaved).

    Under TP a rank's intermediate slice is a contiguous run of HF's interleaved columns, read
    as one slice and split into its gate and up halves; the down bias is added on the first
    slice's rank only, so that the all-reduce sums it once."""

    def __init__(self, hf: dict[str, Any], ctx: ParallelContext) -> None:
        limit = float(hf["swiglu_limit"])
        alpha = float(hf.get("swiglu_alpha") or SWIGLU_ALPHA)
        super().__init__(
            hf_config.num_experts(hf),
            hf["hidden_size"],
            hf_config.moe_intermediate_size(hf),
            functools.partial(clamped_swiglu, alpha=alpha, limit=limit),
            tp=ctx.tp,
            expert_parallel=ctx.expert_parallel,
            silu=False,
        )
        local, inter = self.num_local_experts, self.inter_per_rank
        self.gate_up_proj_bias = nn.Parameter(torch.empty(local, 2 * inter), requires_grad=False)
        self.gate_up_proj_bias.weight_loader = self.gate_up_bias_loader
        self.down_proj_bias = nn.Parameter(
            torch.empty(local, self.hidden_size), requires_grad=False
        )
        self.down_proj_bias.weight_loader = self.down_bias_loader

    def _rows(self) -> slice:
        return slice(self.first_expert, self.first_expert + self.num_local_experts)

    def _columns(self) -> slice:
        """This rank's run of HF's interleaved gate/up columns."""
        size = self.inter_per_rank
        return slice(2 * self.slice_rank * size, 2 * (self.slice_rank + 1) * size)

    @staticmethod
    def _split_interleaved(t: torch.Tensor) -> torch.Tensor:
        """``[..., 2n]`` with gate/up alternating -> ``[..., 2n]`` as ``[gate | up]``."""
        return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)

    def gate_up_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """HF's stacked ``[E, H, 2I]`` gate_up_proj."""
        self._stacked(shard_id, "gate_up_proj")
        shape = (self.num_experts, self.hidden_size, 2 * self.intermediate_size)
        check_shape(loaded, shape, "stacked expert gate_up_proj (gpt-oss layout)")
        part = loaded[self._rows(), :, self._columns()]
        param.data.copy_(self._split_interleaved(part).transpose(1, 2))

    def down_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """HF's stacked ``[E, I, H]`` down_proj."""
        self._stacked(shard_id, "down_proj")
        shape = (self.num_experts, self.intermediate_size, self.hidden_size)
        check_shape(loaded, shape, "stacked expert down_proj (gpt-oss layout)")
        size, rank = self.inter_per_rank, self.slice_rank
        param.data.copy_(loaded[self._rows(), rank * size : (rank + 1) * size].transpose(1, 2))

    def gate_up_bias_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        self._stacked(shard_id, "gate_up_proj_bias")
        check_shape(loaded, (self.num_experts, 2 * self.intermediate_size), "gate_up_proj_bias")
        param.data.copy_(self._split_interleaved(loaded[self._rows(), self._columns()]))

    def down_bias_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        self._stacked(shard_id, "down_proj_bias")
        check_shape(loaded, (self.num_experts, self.hidden_size), "down_proj_bias")
        if self.slice_rank == 0:
            param.data.copy_(loaded[self._rows()])
        else:
            param.data.zero_()

    @staticmethod
    def _stacked(shard_id: Any, what: str) -> None:
        if shard_id is not None:
            raise ValueError(f"{what}: gpt-oss stores its experts stacked, got part {shard_id!r}")


class GptOssAttention(Attention):
    """:class:`Attention` with biases everywhere and this rank's heads' sinks (float32, as the
    kernels take them; the checkpoint's ``self_attn.sinks`` holds every head's)."""

    def __init__(
        self,
        hf: dict[str, Any],
        ctx: ParallelContext,
        ops: KernelOps,
        rotary: Any,
        sliding_window: int | None,
    ) -> None:
        bias = bool(hf.get("attention_bias", True))
        super().__init__(
            hf, ctx, ops, rotary, qkv_bias=bias, o_bias=bias, sliding_window=sliding_window
        )
        heads = self.attn.num_heads
        first = ctx.tp.rank * heads
        total = int(hf["num_attention_heads"])

        def load_sinks(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            check_shape(loaded, (total,), "self_attn.sinks")
            param.data.copy_(loaded[first : first + heads])

        sinks = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        sinks.weight_loader = load_sinks
        self.attn.sinks = sinks


class GptOssForCausalLM(MoECausalLM):
    renamed_modules: ClassVar[dict[str, str]] = {"router": "gate"}

    def build_model(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> nn.Module:
        eps = hf.get("rms_norm_eps", 1e-5)

        def norm(size: int = hf["hidden_size"]) -> nn.Module:
            return GemmaRMSNorm(size, eps, offset=0.0)

        routing = Routing(scoring="topk_softmax", router_bias=True)

        def layer(i: int) -> nn.Module:
            attn = GptOssAttention(hf, ctx, ops, self.rotary(i), self.sliding_window(i))
            mlp = SparseMoeBlock(hf, ctx, ops, routing=routing, experts=GptOssExperts(hf, ctx))
            return PreNormDecoderLayer(attn, mlp, norm)

        return DecoderModel(hf, ctx, layer, norm)

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        if name.endswith(".self_attn.sinks"):
            return name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        return super().checkpoint_target(name)
