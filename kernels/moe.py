"""Mixture-of-experts feed-forward: the torch path (CPU) and ``fused_moe``, the one entry point
that picks it or the Triton kernel (``kernels.triton_moe``) by device.

Every (token, k) routing choice is a *pair*, numbered ``t * top_k + k``. An expert is a SwiGLU
MLP whose gate and up projections are stacked in one weight::

    w13[e]  [2I, H]   rows [0, I) = gate_proj, rows [I, 2I) = up_proj
    w2[e]   [H, I]    down_proj
    out[t]  = sum_k topk_weights[t, k] * w2[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),
              e = topk_ids[t, k]

Under tensor parallelism a rank holds a slice of every expert's intermediate dimension
(``w13 = [gate slice; up slice]``, ``w2[:, :, slice]``) and the ranks' outputs sum (one
all-reduce); under expert parallelism ``expert_map`` says which experts are local and the
ranks' outputs sum likewise.

The torch path groups the pairs by expert (one sort) and runs one GEMM per *active* expert, so
its cost follows the tokens routed, not tokens x experts. Nothing here imports Triton: a CPU
engine never needs it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.backend import triton_available
from kernels.ops import silu_and_mul

__all__ = ["MOE_BACKENDS", "check_moe_args", "fused_moe", "local_expert_ids", "moe_torch"]

MOE_BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fused_moe(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    expert_map: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """The MoE feed-forward of ``x``; Triton on CUDA, torch elsewhere.

    Args:
        x: ``[T, H]`` hidden states, float32, bfloat16 or float16.
        w13: ``[E, 2I, H]`` gate and up projections stacked (gate first), x's dtype.
        w2: ``[E, H, I]`` down projections, x's dtype.
        topk_weights: ``[T, K]`` routing weights (any float dtype; applied in float32).
        topk_ids: ``[T, K]`` integer expert ids in ``[0, E)``, or in ``[0, len(expert_map))``
            with ``expert_map``; a negative id adds nothing. A token may list one expert twice;
            each pair counts. Ids are range-checked on the torch path only (no device sync).
        expert_map: optional ``[E_global]`` integer tensor mapping a global expert id to its
            index in ``w13``/``w2``, or -1 where the expert lives on another rank (expert
            parallelism): such pairs add nothing here.
        backend: ``auto`` (Triton for CUDA tensors when triton is installed, else torch),
            ``triton`` (also CPU tensors under ``TRITON_INTERPRET=1``, for tests) or ``torch``.

    Returns:
        ``[T, H]`` in x's dtype; products accumulate in float32, the sum over K too.
    """
    if backend not in MOE_BACKENDS:
        raise ValueError(f"backend must be one of {MOE_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if x.device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        from kernels import triton_moe

        return triton_moe.fused_moe_triton(
            x, w13, w2, topk_weights, topk_ids, expert_map=expert_map
        )
    return moe_torch(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map)


def moe_torch(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    expert_map: Tensor | None = None,
) -> Tensor:
    """``fused_moe``'s contract in torch: pairs sorted by expert, one GEMM pair per active
    expert. Matmuls run in x's dtype (as the HF models do), the weighted sum in float32."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    ids = local_expert_ids(topk_ids, expert_map, num_experts).flatten()
    if ids.numel() and int(ids.max()) >= num_experts:
        raise ValueError(f"topk_ids must be < the {num_experts} experts, got {int(ids.max())}")
    # Pairs on other ranks (-1) sort after every local expert and are never read.
    ids = torch.where(ids < 0, num_experts, ids)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=num_experts + 1)[:num_experts].tolist()
    weights = topk_weights.reshape(-1).to(torch.float32)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        hidden = silu_and_mul(x[tokens] @ w13[expert].T) @ w2[expert].T
        out.index_add_(0, tokens, hidden.to(torch.float32) * weights[pairs, None])
    return out.to(x.dtype)


def local_expert_ids(topk_ids: Tensor, expert_map: Tensor | None, num_experts: int) -> Tensor:
    """``topk_ids`` as indices into this rank's ``num_experts`` stacked experts (-1: elsewhere)."""
    if expert_map is None:
        return topk_ids
    if expert_map.dim() != 1 or expert_map.dtype.is_floating_point:
        raise ValueError(
            f"expert_map must be a 1-D integer tensor, got {expert_map.dtype} "
            f"{list(expert_map.shape)}"
        )
    if expert_map.device != topk_ids.device:
        raise ValueError(f"expert_map is on {expert_map.device}, topk_ids on {topk_ids.device}")
    return expert_map[topk_ids.long()].to(topk_ids.dtype)


def check_moe_args(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor
) -> None:
    """Shapes and dtypes of ``fused_moe``'s arguments; ValueError names the first bad one."""
    if x.dim() != 2 or x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"x must be [tokens, hidden] float32/bfloat16/float16, got {x.dtype} {list(x.shape)}"
        )
    hidden = x.shape[1]
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(
            f"w13 must be [experts, 2 * intermediate, {hidden}], got {list(w13.shape)}"
        )
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    if w2.shape != (num_experts, hidden, intermediate):
        raise ValueError(
            f"w2 must be [{num_experts}, {hidden}, {intermediate}] to match w13, "
            f"got {list(w2.shape)}"
        )
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"{name} must have x's dtype {x.dtype} and device {x.device}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [{x.shape[0]}, top_k], got {list(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        raise ValueError(
            f"topk_weights must be a float tensor shaped like topk_ids {list(topk_ids.shape)}, "
            f"got {topk_weights.dtype} {list(topk_weights.shape)}"
        )
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
