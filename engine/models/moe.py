"""The sparse mixture-of-experts block every MoE family composes, and the checkpoint naming
its experts share.

    SparseMoeBlock   x ─ gate (router, replicated) ─ scores ─ [groups] ─ top-k ─ weights
                       └─ experts (stacked; TP: intermediate dim sliced, EP: whole ─┐
                          experts per rank, parallel.moe)                           │
                       └─ [shared expert(s), [* sigmoid(shared_expert_gate(x))]] ───┴─ all-reduce

Routing is HF's for each family (``Routing`` says how each one picks and weights its
experts). The routed experts' and the shared experts' partial sums are added before the one
all-reduce of the layer, as a dense MLP's down projection does it (``SparseMoeBlock``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine import hf_config
from engine.models.decoder import CausalLM, GatedMLP, act_and_mul
from llm_kernels.backend import KernelOps
from parallel.moe import ParallelExperts
from parallel.state import ParallelContext

if TYPE_CHECKING:
    from engine.models.expert_load import ExpertLoadCounter
    from llm_kernels.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class Routing:
    """How a family's router picks and weights each token's experts, as HF does for that
    family; the defaults are Qwen2/3-MoE's without ``norm_topk_prob``.

    The router logits in the model dtype (Mixtral, Qwen2/3-MoE) or from float32 activations
    and weight (DeepSeek); scores by softmax in float32 (Mixtral, Qwen, DeepSeek-V2) or sigmoid
    (DeepSeek-V3); DeepSeek's group-limited choice, which keeps only the experts of the
    ``topk_group`` best of ``n_group`` groups (a group scored by its best expert, V2's
    ``group_limited_greedy``, or by the sum of its best two, V3's ``noaux_tc``); V3's
    ``e_score_correction_bias`` added to the scores for the choice only; ``torch.topk`` over
    the choice (ties go wherever torch.topk puts them, as in HF); the chosen experts' scores as
    weights, renormalized to sum to 1 when the family says so (Mixtral always; Qwen2/3-MoE and
    DeepSeek-V3 with ``norm_topk_prob``), times ``routed_scaling_factor`` (DeepSeek), then cast
    to the model dtype (Qwen2/3-MoE) or left in float32 (Mixtral, DeepSeek, whose expert
    outputs are therefore weighted in float32 before the cast back). On CUDA the fused kernel
    weights and sums in float32 whatever the weights' dtype: exact in float32, a
    rounding-level difference from HF's Qwen-MoE in bfloat16.
    """

    renormalize: bool = False
    # "topk_softmax": the top-k of the raw logits, then a softmax over those k in the logits'
    # dtype (gpt-oss); the others score every expert first.
    scoring: Literal["softmax", "sigmoid", "topk_softmax"] = "softmax"
    # A bias on the router's logits (gpt-oss's ``router.bias``).
    router_bias: bool = False
    # The router matmul from float32 activations and a float32 weight (DeepSeek's).
    fp32_logits: bool = False
    # Weights kept in float32 for the expert outputs' weighting (Mixtral, DeepSeek).
    fp32_weights: bool = False
    # DeepSeek-V3's per-expert bias on the scores, for the choice only (``noaux_tc``).
    correction_bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: Literal["max", "top2_sum"] = "max"
    scaling_factor: float = 1.0


def route(
    router_logits: torch.Tensor,
    top_k: int,
    routing: Routing,
    weights_dtype: torch.dtype,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights in ``weights_dtype``, expert ids) of every token, ``[T, top_k]`` each."""
    if routing.scoring == "topk_softmax":
        values, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=values.dtype).to(weights_dtype), ids
    if routing.scoring == "softmax":
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    else:
        scores = router_logits.to(torch.float32).sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if routing.num_groups > 1:
        choice = _limit_to_best_groups(choice, routing)
    ids = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routing.scaling_factor != 1.0:
        weights = weights * routing.scaling_factor
    return weights.to(weights_dtype), ids


def _limit_to_best_groups(choice: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``choice`` with every expert outside its token's ``topk_groups`` best groups at -inf."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, routing.num_groups, experts // routing.num_groups)
    if routing.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, routing.topk_groups, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(tokens, experts)


class ReplicatedLinear(nn.Module):
    """``x W^T`` with the whole ``W`` on every rank (a router, the shared-expert gate)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Router(nn.Module):
    """A sparse layer's gate: the router weight ``[E, H]`` (float32 for ``fp32_logits``, as
    DeepSeek's HF code declares it), its ``bias`` ``[E]`` for ``router_bias`` and, for
    ``correction_bias``, ``e_score_correction_bias`` ``[E]`` in float32; ``forward`` routes
    (``route``)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, routing: Routing) -> None:
        super().__init__()
        dtype = torch.float32 if routing.fp32_logits else None
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False)
            if routing.router_bias
            else None
        )
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            if routing.correction_bias
            else None
        )
        self.top_k = top_k
        self.routing = routing

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.routing.fp32_logits:
            bias = None if self.bias is None else self.bias.to(torch.float32)
            logits = F.linear(x.to(torch.float32), self.weight.to(torch.float32), bias)
        else:
            logits = F.linear(x, self.weight, self.bias)
        weights_dtype = torch.float32 if self.routing.fp32_weights else x.dtype
        return route(logits, self.top_k, self.routing, weights_dtype, self.e_score_correction_bias)


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: ``top_k`` of ``num_experts`` gated-MLP experts per token,
    routed as ``routing`` says, plus, with ``shared_expert_intermediate_size``, an always-on
    shared expert: scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE) or ungated
    (``shared_expert_gated=False``, DeepSeek's ``shared_experts``). ``experts`` replaces the
    gated-MLP experts built from the config (gpt-oss's biased, clamped ones).

    The routed experts' and the shared experts' partial sums are added before the one
    all-reduce of the layer, as a dense MLP's down projection does it. Under expert parallelism
    the shared experts stay TP-sliced (every token uses them, so slicing them balances the
    work; placing them whole on one rank would not), and the routed partial sums (this rank's
    experts) join them in that all-reduce. Qwen2-MoE gates its shared expert by
    ``sigmoid(shared_expert_gate(x))``; DeepSeek adds its ``n_shared_experts`` (one MLP of that
    many times ``moe_intermediate_size``) ungated.
    """

    def __init__(
        self,
        hf: dict[str, Any],
        ctx: ParallelContext,
        ops: KernelOps,
        *,
        routing: Routing,
        shared_expert_intermediate_size: int | None = None,
        shared_expert_gated: bool = True,
        experts: ParallelExperts | None = None,
    ) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        self.tp = ctx.tp
        self.num_experts = hf_config.num_experts(hf)
        self.top_k = int(hf["num_experts_per_tok"])
        self.gate = Router(hidden, self.num_experts, self.top_k, routing)
        self.experts = (
            experts
            if experts is not None
            else ParallelExperts(
                self.num_experts,
                hidden,
                hf_config.moe_intermediate_size(hf),
                act_and_mul(hf, ops),
                tp=ctx.tp,
                expert_parallel=ctx.expert_parallel,
                ep=ctx.ep,
                silu=hf_config.hidden_activation(hf) == "silu",
            )
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
            if shared_expert_gated:
                self.shared_expert_gate = ReplicatedLinear(hidden, 1)
        # (counter, this layer's index) where this rank counts expert load (expert_load.py).
        self.expert_load: tuple[ExpertLoadCounter, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        if self.expert_load is not None:
            counter, layer = self.expert_load
            counter.add(layer, topk_ids)
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                # The gate is one scalar per token, so gating each rank's partial sum and adding
                # the partials equals gating the whole shared expert's output.
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.tp.all_reduce(out)


# HF's per-expert checkpoint names: ``<layer>.mlp.experts.<N>.<proj>.weight`` (Qwen2/3-MoE) or
# ``<layer>.block_sparse_moe.experts.<N>.<w1|w2|w3>.weight`` (Mixtral).
_EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
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
        if renamed == name:
            return None
        packed: dict[str, tuple[str, Any]] = self.packed_modules_mapping
        for hf_name, (fused, part) in packed.items():  # a renamed module's fused projection
            if f".{hf_name}." in renamed:
                return renamed.replace(f".{hf_name}.", f".{fused}."), part
        return renamed, None

    def checkpoint_skipped(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to a multi-token-prediction layer:
        DeepSeek-V3 and GLM-4.5 append ``num_nextn_predict_layers`` of them after the last
        decoder layer (``model.layers.{num_hidden_layers + i}.*``), not part of the model."""
        match = _LAYER.match(name)
        layers = int(self.hf["num_hidden_layers"])
        extra = int(self.hf.get("num_nextn_predict_layers") or 0)
        return match is not None and layers <= int(match[1]) < layers + extra

    def checkpoint_parts(self, param_name: str) -> frozenset[Any] | None:
        """The per-expert slots stacked parameter ``param_name`` needs; None for the others."""
        if not param_name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return None
        module = self.get_submodule(param_name.rsplit(".", 1)[0])
        if not isinstance(module, ParallelExperts):
            return None
        return module.expected_parts(param_name.rsplit(".", 1)[1])
