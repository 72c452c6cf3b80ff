"""Mixture-of-experts experts, sharded one of two ways over the TP group; either way
``forward`` returns this rank's partial sum and the caller all-reduces once per layer.

Tensor parallel (the default): every rank holds a slice of every expert's intermediate
dimension, so the expert compute is an MLP sharded like ``GatedMLP`` (gate/up split by output
rows, down by input columns)::

    gate_up_proj  [E, 2 * I/tp, H]   rank r: [gate rows r*I/tp ... ; up rows r*I/tp ...]
    down_proj     [E, H, I/tp]       rank r: columns r*I/tp ...

Expert parallel (``enable_expert_parallel``): rank r of the EP group holds the whole experts
``[r*E/ep, (r+1)*E/ep)``, nothing of the others::

    gate_up_proj  [E/ep, 2I, H]      down_proj  [E/ep, H, I]

When the EP group is the TP group, attention is TP-sharded, so every rank already holds every
token's hidden states: the dispatch is free (each rank computes the (token, expert) pairs whose
expert it owns) and the combine is the layer's one all-reduce, of the same ``[T, H]`` bytes as TP.
With data-parallel attention the EP group spans every DP x TP rank, whose tokens differ: the
pairs go to their experts' ranks and back by all-to-all (``ParallelExperts._exchange``,
docs/moe.md). Compute: ``llm_kernels.moe.fused_moe`` on CUDA, :func:`grouped_experts`
elsewhere (``ParallelExperts`` says how checkpoints load).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llm_kernels.cpu_gemm import pack_linear_weight, packed_linear
from llm_kernels.moe import fused_moe
from parallel.layers import check_shape, divide
from parallel.state import SINGLE, GroupCoordinator

ActAndMul = Callable[[torch.Tensor], torch.Tensor]
Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def grouped_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor | Sequence[torch.Tensor],
    down_proj: torch.Tensor | Sequence[torch.Tensor],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    act_and_mul: ActAndMul,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    linear: Linear = F.linear,
) -> torch.Tensor:
    """``sum_k w[t, k] * down_e(act_and_mul(gate_up_e(x[t])))`` with ``e = topk_ids[t, k]``;
    a negative id (an expert on another rank) adds nothing. The ``T x K`` pairs are sorted by
    expert, and each local expert that received tokens runs one GEMM over its contiguous run
    of rows; experts with no tokens (or on another rank) cost nothing. The routing weights
    multiply each pair's output in their own dtype, then the K outputs of a token are summed in
    top-k order and cast to the activations' dtype, as HF's ``grouped_mm`` experts do. This and
    ``fused_moe`` agree exactly in float32; in bfloat16 a Qwen-MoE model (whose HF code weights
    in the model dtype) differs from HF by the kernel's float32 weighting, a rounding-level
    difference, as vLLM's fused MoE does too. ``gate_up_bias`` ``[E, 2I]`` and
    ``down_bias`` ``[E, H]``, when given, are each expert's projection biases.

    ``x`` ``[T, H]``; ``gate_up_proj`` ``[E, 2I, H]``; ``down_proj`` ``[E, H, I]``;
    ``topk_ids`` / ``topk_weights`` ``[T, K]``. Returns ``[T, H]`` in ``x``'s dtype. The
    projections may instead be one weight per expert in whatever form ``linear`` multiplies
    (``packed_linear`` and the oneDNN-packed weights of :meth:`ParallelExperts.pack_weights`).
    """
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return x.new_zeros(0, x.shape[-1])
    pair_out = _pair_outputs(
        x, top_k, topk_ids.reshape(-1), gate_up_proj, down_proj, act_and_mul,
        gate_up_bias, down_bias, linear,
    )  # fmt: skip
    return _weighted_sum(pair_out, topk_weights, x.dtype)


def _pair_outputs(
    x: torch.Tensor,
    pairs_per_row: int,
    ids: torch.Tensor,
    gate_up_proj: torch.Tensor | Sequence[torch.Tensor],
    down_proj: torch.Tensor | Sequence[torch.Tensor],
    act_and_mul: ActAndMul,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    linear: Linear,
) -> torch.Tensor:
    """Each (token, expert) pair's output, not yet weighted: ``[P, H]`` in pair order, pair
    ``p`` being row ``x[p // pairs_per_row]`` through local expert ``ids[p]`` (zeros for a
    negative id). One GEMM per expert over its pairs' rows, sorted stably by expert."""
    num_experts = len(gate_up_proj)
    # Non-local pairs get the id num_experts: they sort last and no GEMM reads them.
    ids = torch.where(ids < 0, num_experts, ids)
    # Stable, so the pairs of one expert keep token order (deterministic row order per GEMM).
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=num_experts + 1)
    # One host sync for the whole layer: each active expert's run [end - count, end).
    ends = torch.cumsum(counts, 0).tolist()
    sizes = counts.tolist()[:num_experts]
    rows = x[order // pairs_per_row]
    sorted_out = x.new_zeros(ids.shape[0], x.shape[-1])
    for expert in (e for e, n in enumerate(sizes) if n):
        end = ends[expert]
        start = end - sizes[expert]
        b13 = None if gate_up_bias is None else gate_up_bias[expert]
        b2 = None if down_bias is None else down_bias[expert]
        inter = act_and_mul(linear(rows[start:end], gate_up_proj[expert], b13))
        sorted_out[start:end] = linear(inter, down_proj[expert], b2)
    pair_out = torch.empty_like(sorted_out)
    pair_out[order] = sorted_out
    return pair_out


def _weighted_sum(
    pair_out: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[T * K, H]`` pair outputs (token-major) weighted by ``[T, K]`` routing weights in their
    dtype, summed over the K in top-k order, cast to ``dtype``."""
    num_tokens, top_k = topk_weights.shape
    weighted = pair_out.view(num_tokens, top_k, -1) * topk_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(dtype)


class ParallelExperts(nn.Module):
    """The stacked gated-MLP experts of one MoE layer: sliced over the TP group on the
    intermediate dimension, or (``expert_parallel``) whole experts split evenly over the EP
    group (``ep``, the TP group unless data-parallel attention gives a wider one).
    ``forward`` returns this rank's partial sum (not all-reduced). ``silu`` says the
    activation is SiLU, the one the fused CUDA kernel computes. ``dense=False`` registers no
    dense ``gate_up_proj`` / ``down_proj``: a subclass that keeps its experts in another format
    (gpt-oss's MXFP4) registers its own.

    A checkpoint stores the experts either one tensor per expert and projection (HF's
    ``experts.N.gate_proj.weight`` ..., what ``save_pretrained`` writes; ``shard_id`` =
    ``(N, 0 | 1)`` for gate / up, ``N`` for down) or already stacked (``experts.gate_up_proj``
    ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``, ``shard_id=None``); either way a
    rank reads only its rows / columns (TP) or its experts (EP) and skips another rank's expert.

    Compute: on CUDA the Triton ``llm_kernels.moe.fused_moe`` (with an ``expert_map`` under EP; it
    applies the routing weights and sums the top-k in float32). Elsewhere :func:`grouped_experts`;
    on CPU the loader packs each expert's weights once into oneDNN's layout
    (:meth:`pack_weights`, ``llm_kernels.cpu_gemm``), and its GEMMs are ``packed_linear`` calls.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        act_and_mul: ActAndMul,
        *,
        tp: GroupCoordinator = SINGLE,
        expert_parallel: bool = False,
        ep: GroupCoordinator | None = None,
        silu: bool = True,
        dense: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.expert_parallel = expert_parallel
        # The EP group: the TP group, or (data-parallel attention) every DP x TP rank, whose
        # members hold different tokens and exchange them (``_exchange``).
        self.ep = (ep or tp) if expert_parallel else SINGLE
        self.exchanges_tokens = expert_parallel and ep is not None and ep.size > tp.size
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.act_and_mul = act_and_mul
        self.silu = silu
        # EP: whole experts, a contiguous block per rank. TP: every expert, a slice of each.
        ep_size, ep_rank = self.ep.size, self.ep.rank
        self.slice_size, self.slice_rank = (1, 0) if expert_parallel else (tp.size, tp.rank)
        what = "num_experts (enable_expert_parallel)"
        self.num_local_experts = divide(num_experts, ep_size, what)
        self.first_expert = ep_rank * self.num_local_experts
        self.inter_per_rank = divide(intermediate_size, self.slice_size, "moe intermediate size")
        self._expert_map: torch.Tensor | None = None
        local, inter = self.num_local_experts, self.inter_per_rank
        self.gate_up_proj: nn.Parameter | None = None
        self.down_proj: nn.Parameter | None = None
        if dense:
            self.gate_up_proj = nn.Parameter(
                torch.empty(local, 2 * inter, hidden_size), requires_grad=False
            )
            self.gate_up_proj.weight_loader = self.gate_up_loader
            self.down_proj = nn.Parameter(
                torch.empty(local, hidden_size, inter), requires_grad=False
            )
            self.down_proj.weight_loader = self.down_loader
        # Per-expert projection biases, set by experts that have them (gpt-oss's).
        self.gate_up_proj_bias: nn.Parameter | None
        self.down_proj_bias: nn.Parameter | None
        self.register_parameter("gate_up_proj_bias", None)
        self.register_parameter("down_proj_bias", None)
        # Each local expert's gate_up and down weights in oneDNN's layout, set by
        # ``pack_weights`` on CPU; the plain parameters are then meta tensors of their shape.
        self.packed_gate_up: list[torch.Tensor] | None = None
        self.packed_down: list[torch.Tensor] | None = None

    def pack_weights(self) -> bool:
        """Pack every local expert's two projections into oneDNN's layout once loaded (as
        ``parallel.layers.pack_linear_weights`` does for dense layers) and release the plain
        stacked weights, keeping their shapes on the meta device; False (nothing changed) where
        the packed path does not cover their device or dtype, they are packed already, or the
        experts keep a quantized form instead (gpt-oss's MXFP4 on the Triton backend)."""
        plain = self.gate_up_proj
        if self.packed_gate_up is not None or plain is None or plain.is_meta:
            return False
        gate_up = [pack_linear_weight(w) for w in self.gate_up_proj.data]
        down = [pack_linear_weight(w) for w in self.down_proj.data]
        if any(w is None for w in gate_up + down):
            return False
        self.packed_gate_up, self.packed_down = gate_up, down
        for name in ("gate_up_proj", "down_proj"):
            plain = getattr(self, name)
            meta = nn.Parameter(plain.data.to("meta"), requires_grad=False)
            meta.weight_loader = plain.weight_loader
            setattr(self, name, meta)
        return True

    def packed_nbytes(self) -> int:
        """Bytes of the packed expert weights, counted at their plain size (the meta
        parameters' shapes); 0 when not packed."""
        if self.packed_gate_up is None:
            return 0
        return sum(p.numel() * p.element_size() for p in (self.gate_up_proj, self.down_proj))

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.exchanges_tokens:
            return self._exchange(x, topk_ids, topk_weights)
        biased = self.gate_up_proj_bias is not None or self.down_proj_bias is not None
        if x.device.type == "cuda" and self.silu and not biased:
            expert_map = self.expert_map(x.device) if self.expert_parallel else None
            w13, w2 = self.gate_up_proj, self.down_proj
            return fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map)
        if self.expert_parallel:
            local = topk_ids - self.first_expert
            in_range = (local >= 0) & (local < self.num_local_experts)
            topk_ids = torch.where(in_range, local, -1)
        w13, w2, linear = self._weights()
        biases = (self.gate_up_proj_bias, self.down_proj_bias)
        return grouped_experts(
            x, w13, w2, topk_ids, topk_weights, self.act_and_mul, *biases, linear
        )

    def _weights(self) -> tuple[Any, Any, Linear]:
        """(gate_up, down, the linear that multiplies them): oneDNN-packed once loaded on
        CPU, else the plain stacked parameters and ``F.linear``."""
        if self.packed_gate_up is not None and self.packed_down is not None:
            return self.packed_gate_up, self.packed_down, packed_linear
        return self.gate_up_proj, self.down_proj, F.linear

    def _exchange(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Dispatch and combine over the EP group when its members hold different tokens
        (data-parallel attention). Every EP rank calls it in every MoE layer, tokens or none.

        The DP rank's ``T`` tokens are replicated over its TP group, so TP rank ``r`` sends the
        ``r``-th of ``tp.size`` contiguous chunks, each (token, expert) pair once, to the EP rank
        owning the expert (rows sorted by owner, one ``all_to_all`` after the counts: three
        collectives a layer in all). The owner
        computes the pairs it receives, unweighted (``_pair_outputs``), and sends them back in
        the order they came; the source weights them and sums each token's K in top-k order,
        the arithmetic ``grouped_experts`` does on one rank holding every expert. The partial
        sum holds this rank's chunk, zeros elsewhere: the layer's TP all-reduce joins the chunks.
        A CUDA build would plug an all-to-all kernel (DeepEP, pplx) and ``fused_moe`` in here.
        """
        num_tokens, top_k = topk_ids.shape
        chunk = -(-num_tokens // self.tp.size)
        lo = min(num_tokens, self.tp.rank * chunk)
        hi = min(num_tokens, lo + chunk)
        ids = topk_ids[lo:hi].reshape(-1).long()
        owner = torch.div(ids, self.num_local_experts, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=self.ep.size).tolist()
        recv_counts = self.ep.all_to_all_counts(send_counts)
        # Each row carries its pair's local expert id in extra columns, the int32's bits viewed
        # as the activations' dtype, so rows and ids travel in one all-to-all.
        local_ids = (ids - owner * self.num_local_experts)[order].to(torch.int32)
        tagged = torch.cat([x[lo:hi][order // top_k], local_ids.unsqueeze(1).view(x.dtype)], 1)
        received = self.ep.all_to_all(tagged, send_counts, recv_counts)
        rows = received[:, : self.hidden_size]
        local_ids = received[:, self.hidden_size :].contiguous().view(torch.int32).squeeze(1).long()
        w13, w2, linear = self._weights()
        biases = (self.gate_up_proj_bias, self.down_proj_bias)
        out = _pair_outputs(rows, 1, local_ids, w13, w2, self.act_and_mul, *biases, linear)
        back = self.ep.all_to_all(out, recv_counts, send_counts)
        pair_out = torch.empty_like(back)
        pair_out[order] = back
        partial = x.new_zeros(num_tokens, self.hidden_size)
        if hi > lo:
            partial[lo:hi] = _weighted_sum(pair_out, topk_weights[lo:hi], x.dtype)
        return partial

    def expert_map(self, device: torch.device) -> torch.Tensor:
        """``[E]`` int32: a global expert id's index among this rank's experts, -1 for another
        rank's (``fused_moe``'s ``expert_map``). Kept off the module's buffers: it is derived,
        not state, and the memory plan counts buffers exactly."""
        if self._expert_map is None or self._expert_map.device != device:
            ids = torch.arange(self.num_experts, device=device, dtype=torch.int32)
            local = ids - self.first_expert
            owned = (local >= 0) & (local < self.num_local_experts)
            self._expert_map = torch.where(owned, local, -1).to(torch.int32)
        return self._expert_map

    def owns(self, expert: int) -> bool:
        """Whether global expert ``expert``'s weights live on this rank."""
        return self.first_expert <= expert < self.first_expert + self.num_local_experts

    def _expert(self, shard_id: Any, what: str) -> int:
        if isinstance(shard_id, bool) or not isinstance(shard_id, int):
            raise ValueError(f"shard_id: {what} needs an expert index, got {shard_id!r}")
        if not 0 <= shard_id < self.num_experts:
            raise ValueError(
                f"expert index {shard_id} out of range: num_experts is {self.num_experts}"
            )
        return shard_id

    def gate_up_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """A stacked ``[E, 2I, H]`` tensor (``shard_id=None``) or one expert's gate (part 0)
        or up (part 1) projection ``[I, H]`` (``shard_id=(expert, part)``); another EP rank's
        expert is skipped."""
        inter, size, rank = self.intermediate_size, self.inter_per_rank, self.slice_rank
        if shard_id is None:
            check_shape(
                loaded, (self.num_experts, 2 * inter, self.hidden_size), "stacked expert gate_up"
            )
            first, end = self.first_expert, self.first_expert + self.num_local_experts
            for part in (0, 1):
                start = part * inter + rank * size
                param.data[:, part * size : (part + 1) * size].copy_(
                    loaded[first:end, start : start + size]
                )
            return
        if not isinstance(shard_id, tuple) or len(shard_id) != 2 or shard_id[1] not in (0, 1):
            raise ValueError(f"shard_id: must be (expert, 0 | 1) for gate / up, got {shard_id!r}")
        expert = self._expert(shard_id[0], "gate_up_proj")
        part = shard_id[1]
        check_shape(loaded, (inter, self.hidden_size), f"expert {expert} part {part}")
        if not self.owns(expert):
            return
        rows = loaded[rank * size : (rank + 1) * size]
        param.data[expert - self.first_expert, part * size : (part + 1) * size].copy_(rows)

    def down_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """A stacked ``[E, H, I]`` tensor (``shard_id=None``) or one expert's ``[H, I]``
        (``shard_id=expert``); another EP rank's expert is skipped."""
        inter, size, rank = self.intermediate_size, self.inter_per_rank, self.slice_rank
        if shard_id is None:
            check_shape(
                loaded, (self.num_experts, self.hidden_size, inter), "stacked expert down_proj"
            )
            first, end = self.first_expert, self.first_expert + self.num_local_experts
            param.data.copy_(loaded[first:end, :, rank * size : (rank + 1) * size])
            return
        expert = self._expert(shard_id, "down_proj")
        check_shape(loaded, (self.hidden_size, inter), f"expert {expert} down_proj")
        if not self.owns(expert):
            return
        param.data[expert - self.first_expert].copy_(loaded[:, rank * size : (rank + 1) * size])

    def expected_parts(self, param_name: str) -> frozenset[Any]:
        """The per-expert shard ids that fill parameter ``param_name`` (``gate_up_proj`` or
        ``down_proj``) when the checkpoint stores one tensor per expert: this rank's experts
        (global ids)."""
        experts = range(self.first_expert, self.first_expert + self.num_local_experts)
        if param_name == "gate_up_proj":
            return frozenset((e, p) for e in experts for p in (0, 1))
        return frozenset(experts)


def pack_expert_weights(model: nn.Module) -> int:
    """Pack the experts of every MoE layer of ``model`` (:meth:`ParallelExperts.pack_weights`);
    returns how many layers were packed."""
    return sum(m.pack_weights() for m in model.modules() if isinstance(m, ParallelExperts))
