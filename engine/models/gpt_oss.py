"""gpt-oss (``GptOssForCausalLM``): grouped-query attention with q/k/v/o biases and a learned
per-head sink logit in every softmax (``self_attn.sinks``, see ``PagedAttention.sinks``),
sliding-window and full layers as ``layer_types`` alternates them, yarn rope; every layer a
MoE whose router has a bias and picks the top-k logits before a softmax over them, and whose
experts have biases and gpt-oss's clamped SwiGLU. RMSNorm scales in float32 (HF keeps the
norms in float32).

Checkpoints store the experts stacked in HF's layout: ``experts.gate_up_proj``
``[E, H, 2I]`` with gate and up columns interleaved, ``experts.down_proj`` ``[E, I, H]``,
``gate_up_proj_bias`` ``[E, 2I]`` and ``down_proj_bias`` ``[E, H]``; :class:`GptOssExperts`
reads a rank's part of them into the engine's ``[gate; up]`` layout. An MXFP4 checkpoint
(gpt-oss's release) is dequantized into that layout at load, except on the Triton kernels
(CUDA), where the experts keep the checkpoint's ``_blocks`` / ``_scales`` (a rank's rows of
them) and ``llm_kernels.moe.fused_moe_mxfp4`` dequantizes inside its GEMMs.
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
from engine.quantization.config import keeps_mxfp4_experts
from llm_kernels.backend import KernelOps
from llm_kernels.moe import clamped_swiglu, fused_moe_mxfp4
from llm_kernels.moe_inputs import Mxfp4Experts
from llm_kernels.mxfp4 import BYTES_PER_GROUP, VALUES_PER_SCALE
from parallel.layers import check_shape
from parallel.moe import ParallelExperts
from parallel.state import ParallelContext

# HF's GptOssConfig default; released configs leave it out.
SWIGLU_ALPHA = 1.702


def swiglu_halves(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of ``x = [gate | up]`` (the engine's layout)."""
    gate, up = x.chunk(2, dim=-1)
    return clamped_swiglu(gate, up, alpha, limit)


class GptOssExperts(ParallelExperts):
    """gpt-oss's experts: :class:`ParallelExperts` with projection biases, the clamped
    SwiGLU, and loaders for HF's stacked layout (transposed, gate/up columns interleaved).

    Under TP a rank's intermediate slice is a contiguous run of HF's interleaved columns, read
    as one slice and split into its gate and up halves; the down bias is added on the first
    slice's rank only, so that the all-reduce sums it once.

    Kept in MXFP4 (``mxfp4``: an MXFP4 checkpoint on the Triton kernels), the parameters are
    the checkpoint's, a rank's part of them, gate and up rows still interleaved::

        gate_up_proj_blocks [E_local, 2I/tp, H/32, 16]  gate_up_proj_scales [E_local, 2I/tp, H/32]
        down_proj_blocks    [E_local, H, G, 16]         down_proj_scales    [E_local, H, G]
        gate_up_proj_bias   [E_local, 2I/tp] (interleaved)   down_proj_bias [E_local, H]

    where G groups cover the rank's inputs ``[r I/tp, (r+1) I/tp)`` of down_proj's rows, the
    first starting ``w2_offset`` values into its group."""

    def __init__(self, hf: dict[str, Any], ctx: ParallelContext, ops: KernelOps) -> None:
        limit = float(hf["swiglu_limit"])
        alpha = float(hf.get("swiglu_alpha") or SWIGLU_ALPHA)
        mxfp4 = keeps_mxfp4_experts(hf, ops.name)
        super().__init__(
            hf_config.num_experts(hf),
            hf["hidden_size"],
            hf_config.moe_intermediate_size(hf),
            functools.partial(swiglu_halves, alpha=alpha, limit=limit),
            tp=ctx.tp,
            expert_parallel=ctx.expert_parallel,
            ep=ctx.ep,
            silu=False,
            dense=not mxfp4,
        )
        if mxfp4 and self.exchanges_tokens:
            raise ValueError(
                "enable_expert_parallel with data parallelism: gpt-oss's MXFP4 experts kept "
                "quantized (Triton backend) have no token exchange; load them dequantized"
            )
        self.alpha, self.limit, self.mxfp4 = alpha, limit, mxfp4
        local, inter = self.num_local_experts, self.inter_per_rank
        self.gate_up_proj_bias = nn.Parameter(torch.empty(local, 2 * inter), requires_grad=False)
        self.gate_up_proj_bias.weight_loader = self.gate_up_bias_loader
        self.down_proj_bias = nn.Parameter(
            torch.empty(local, self.hidden_size), requires_grad=False
        )
        self.down_proj_bias.weight_loader = self.down_bias_loader
        if mxfp4:
            self._register_mxfp4()

    def _input_groups(self) -> tuple[int, int]:
        """down_proj's groups ``[first, end)`` that hold this rank's inputs."""
        start = self.slice_rank * self.inter_per_rank
        return start // VALUES_PER_SCALE, -(-(start + self.inter_per_rank) // VALUES_PER_SCALE)

    def _register_mxfp4(self) -> None:
        local, inter, hidden = self.num_local_experts, self.inter_per_rank, self.hidden_size
        first, end = self._input_groups()
        shapes = {
            "gate_up_proj": (local, 2 * inter, hidden // VALUES_PER_SCALE),
            "down_proj": (local, hidden, end - first),
        }
        for proj, shape in shapes.items():
            for part, full in (("blocks", (*shape, BYTES_PER_GROUP)), ("scales", shape)):
                param = nn.Parameter(torch.empty(full, dtype=torch.uint8), requires_grad=False)
                param.weight_loader = functools.partial(self._mxfp4_loader, proj, part)
                self.register_parameter(f"{proj}_{part}", param)

    def _mxfp4_loader(
        self, proj: str, part: str, param: nn.Parameter, loaded: Any, shard_id: Any = None
    ) -> None:
        """The checkpoint's ``{proj}_{part}``: this rank's experts and rows (gate_up) or input
        groups (down)."""
        self._stacked(shard_id, f"{proj}_{part}")
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        groups = (
            (e, 2 * i, h // VALUES_PER_SCALE)
            if proj == "gate_up_proj"
            else (e, h, i // VALUES_PER_SCALE)
        )
        shape = (*groups, BYTES_PER_GROUP) if part == "blocks" else groups
        check_shape(loaded, shape, f"experts.{proj}_{part} (MXFP4)")
        if proj == "gate_up_proj":
            param.data.copy_(loaded[self._rows(), self._columns()])
        else:
            first, end = self._input_groups()
            param.data.copy_(loaded[self._rows(), :, first:end])

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if not self.mxfp4:
            return super().forward(x, topk_ids, topk_weights)
        experts = Mxfp4Experts(
            self.gate_up_proj_blocks,
            self.gate_up_proj_scales,
            self.gate_up_proj_bias,
            self.down_proj_blocks,
            self.down_proj_scales,
            self.down_proj_bias,
            w2_offset=self.slice_rank * self.inter_per_rank % VALUES_PER_SCALE,
        )
        expert_map = self.expert_map(x.device) if self.expert_parallel else None
        return fused_moe_mxfp4(
            x, experts, topk_weights, topk_ids, alpha=self.alpha, limit=self.limit,
            expert_map=expert_map, backend="triton",
        )  # fmt: skip

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
        """HF's interleaved ``[E, 2I]``: split into ``[gate | up]``, or kept interleaved beside
        MXFP4 rows."""
        self._stacked(shard_id, "gate_up_proj_bias")
        check_shape(loaded, (self.num_experts, 2 * self.intermediate_size), "gate_up_proj_bias")
        part = loaded[self._rows(), self._columns()]
        param.data.copy_(part if self.mxfp4 else self._split_interleaved(part))

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
            experts = GptOssExperts(hf, ctx, ops)
            mlp = SparseMoeBlock(hf, ctx, ops, routing=routing, experts=experts)
            return PreNormDecoderLayer(attn, mlp, norm)

        return DecoderModel(hf, ctx, layer, norm)

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        if name.endswith(".self_attn.sinks"):
            return name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        return super().checkpoint_target(name)
