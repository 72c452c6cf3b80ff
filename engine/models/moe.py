"""The sparse mixture-of-experts block every MoE family composes, and the checkpoint naming
its experts share.

    SparseMoeBlock   x ─ gate (router, replicated) ─ softmax (fp32) ─ top-k ─ [renormalize]
                       └─ experts (stacked; TP: intermediate dim sliced, EP: whole ─┐
                          experts per rank, parallel.moe)                           │
                       └─ [shared_expert * sigmoid(shared_expert_gate(x))] ─────────┴─ all-reduce

Routing is HF's for each family: the router logits in the model dtype, softmax in float32,
``torch.topk`` over the probabilities (so ties go wherever torch.topk puts them, as in HF), the
top-k renormalized to sum to 1 when the family says so (Mixtral always; Qwen2/3-MoE with
``norm_topk_prob``), then the weights cast to the model dtype (Qwen2/3-MoE) or left in float32
(Mixtral, whose expert outputs are therefore weighted and summed in float32 before the cast
back). On CUDA the fused kernel weights and sums in float32 whatever the weights' dtype:
exact in float32, a rounding-level difference from HF's Qwen-MoE in bfloat16. The routed
experts' and the shared expert's partial sums are added before the one all-reduce of the
layer, as a dense MLP's down projection does it. Under expert parallelism the shared expert
stays TP-sliced (every token uses it, so slicing it balances the work; placing it whole on one
rank would not), and the routed partial sums (this rank's experts) join it in that all-reduce.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine import hf_config
from engine.models.decoder import CausalLM, GatedMLP, act_and_mul
from kernels.backend import KernelOps
from parallel.moe import ParallelExperts
from parallel.state import ParallelContext

if TYPE_CHECKING:
    from engine.models.expert_load import ExpertLoadCounter
    from kernels.attention import AttentionMetadata


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights in ``weights_dtype``, expert ids) of every token, ``[T, top_k]`` each."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


class ReplicatedLinear(nn.Module):
    """``x W^T`` with the whole ``W`` on every rank (a router, the shared-expert gate)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: ``top_k`` of ``num_experts`` gated-MLP experts per token,
    plus, with ``shared_expert_intermediate_size``, Qwen2-MoE's always-on shared expert scaled
    by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(
        self,
        hf: dict[str, Any],
        ctx: ParallelContext,
        ops: KernelOps,
        *,
        renormalize: bool,
        fp32_routing_weights: bool = False,
        shared_expert_intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        self.tp = ctx.tp
        self.num_experts = hf_config.num_experts(hf)
        self.top_k = int(hf["num_experts_per_tok"])
        self.renormalize = renormalize
        self.fp32_routing_weights = fp32_routing_weights
        self.gate = ReplicatedLinear(hidden, self.num_experts)
        self.experts = ParallelExperts(
            self.num_experts,
            hidden,
            hf_config.moe_intermediate_size(hf),
            act_and_mul(hf, ops),
            tp=ctx.tp,
            expert_parallel=ctx.expert_parallel,
            silu=hf_config.hidden_activation(hf) == "silu",
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(
                hf,
                ctx,
                ops,
                intermediate_size=shared_expert_intermediate_size,
                reduce_results=False,
            )
            self.shared_expert_gate = ReplicatedLinear(hidden, 1)
        # (counter, this layer's index) where this rank counts expert load (expert_load.py).
        self.expert_load: tuple[ExpertLoadCounter, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights_dtype = torch.float32 if self.fp32_routing_weights else x.dtype
        topk_weights, topk_ids = route(self.gate(x), self.top_k, self.renormalize, weights_dtype)
        if self.expert_load is not None:
            counter, layer = self.expert_load
            counter.add(layer, topk_ids)
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # The gate is one scalar per token, so gating each rank's partial sum and adding
            # the partials equals gating the whole shared expert's output.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


# HF's per-expert checkpoint names: ``<layer>.mlp.experts.<N>.<proj>.weight`` (Qwen2/3-MoE) or
# ``<layer>.block_sparse_moe.experts.<N>.<w1|w2|w3>.weight`` (Mixtral).
_EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$"
)
_EXPERT_PROJECTIONS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
}


class MoECausalLM(CausalLM):
    """A causal LM whose sparse layers hold a :class:`SparseMoeBlock` at ``<layer>.mlp``.

    The loader asks :meth:`checkpoint_target` where a checkpoint tensor goes before it tries
    ``packed_modules_mapping``: one expert's projection goes into its slot of the stacked
    ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``; a stacked tensor (transformers'
    in-memory layout) has those names already. :meth:`checkpoint_parts` says which slots a
    stacked parameter needs, so an expert the checkpoint lacks is named."""

    # Checkpoint module names that this model calls ``mlp`` (Mixtral's ``block_sparse_moe``).
    renamed_modules: ClassVar[dict[str, str]] = {}
    # The per-layer expert-load counter, where this rank counts (engine.models.expert_load).
    expert_load: ExpertLoadCounter | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.expert_load is not None:
            self.expert_load.begin_forward(metadata)
        return super().forward(input_ids, positions, metadata, hidden, residual)

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        """(parameter name, shard id) of checkpoint tensor ``name``; None: not an expert's
        tensor nor a renamed module's (``packed_modules_mapping`` decides)."""
        renamed = name
        for old, new in self.renamed_modules.items():
            renamed = renamed.replace(f".{old}.", f".{new}.")
        match = _EXPERT_TENSOR.match(renamed)
        proj = _EXPERT_PROJECTIONS.get(match["proj"]) if match is not None else None
        if match is not None and proj is not None:
            param, part = proj
            expert = int(match["expert"])
            shard_id = expert if part is None else (expert, part)
            return f"{match['prefix']}.mlp.experts.{param}", shard_id
        return (renamed, None) if renamed != name else None

    def checkpoint_parts(self, param_name: str) -> frozenset[Any] | None:
        """The per-expert slots stacked parameter ``param_name`` needs; None for the others."""
        if not param_name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return None
        module = self.get_submodule(param_name.rsplit(".", 1)[0])
        if not isinstance(module, ParallelExperts):
            return None
        return module.expected_parts(param_name.rsplit(".", 1)[1])
