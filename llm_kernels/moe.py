"""Mixture-of-experts feed-forward: the torch path (CPU) and ``fused_moe``, the one entry point
that picks it or the Triton kernel (``llm_kernels.triton_moe``) by device.

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
its cost follows the tokens routed, not tokens x experts. Triton (an optional dependency a CPU
engine never needs) is imported only when the Triton backend is picked.

``fused_moe_mxfp4`` is the same for experts kept in MXFP4 (``llm_kernels.moe_inputs.Mxfp4Experts``,
gpt-oss's checkpoint layout: gate and up rows interleaved, per-expert biases) with gpt-oss's
clamped SwiGLU; the Triton kernel (``llm_kernels.triton_mxfp4_moe``) dequantizes inside the
GEMMs, the torch path dequantizes each active expert (a reference, and the fallback off CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from llm_kernels.backend import triton_available
from llm_kernels.moe_inputs import Mxfp4Experts, check_moe_args, check_moe_inputs, local_expert_ids
from llm_kernels.ops import silu_and_mul

__all__ = [
    "MOE_BACKENDS",
    "clamped_swiglu",
    "clamped_swiglu_interleaved",
    "fused_moe",
    "fused_moe_mxfp4",
    "moe_mxfp4_torch",
    "moe_torch",
]

MOE_BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")


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
    backend = _resolve_backend(backend, x)
    if backend == "triton":
        from llm_kernels import triton_moe

        return triton_moe.fused_moe_triton(
            x, w13, w2, topk_weights, topk_ids, expert_map=expert_map
        )
    return moe_torch(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map)


def _resolve_backend(backend: str, x: Tensor) -> str:
    """``backend`` checked, ``auto`` made Triton for CUDA tensors when triton is installed."""
    if backend not in MOE_BACKENDS:
        raise ValueError(f"backend must be one of {MOE_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if x.device.type == "cuda" and triton_available() else "torch"
    return backend


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

    def expert_mlp(expert: int, rows: Tensor) -> Tensor:
        return silu_and_mul(rows @ w13[expert].T) @ w2[expert].T

    return _grouped_by_expert(x, topk_weights, topk_ids, expert_map, w13.shape[0], expert_mlp)


def _grouped_by_expert(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    expert_map: Tensor | None,
    num_experts: int,
    expert_mlp: Callable[[int, Tensor], Tensor],
) -> Tensor:
    """``sum_k w[t, k] * expert_mlp(e, x[t])`` with the pairs sorted by expert and one call per
    active expert; weighted and summed in float32, returned in x's dtype."""
    num_tokens, top_k = topk_ids.shape
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
        hidden = expert_mlp(expert, x[tokens])
        out.index_add_(0, tokens, hidden.to(torch.float32) * weights[pairs, None])
    return out.to(x.dtype)


def clamped_swiglu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's activation: ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, limit)``, in the inputs' dtype as HF computes it."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_swiglu_interleaved(h: Tensor, alpha: float, limit: float) -> Tensor:
    """:func:`clamped_swiglu` of ``h [..., 2I]`` with gate and up interleaved (the checkpoint's
    layout)."""
    return clamped_swiglu(h[..., 0::2], h[..., 1::2], alpha, limit)


def fused_moe_mxfp4(
    x: Tensor,
    experts: Mxfp4Experts,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    alpha: float,
    limit: float,
    expert_map: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """gpt-oss's MoE feed-forward of ``x`` over MXFP4 experts; Triton on CUDA, torch elsewhere.

    Per pair ``(t, k)`` with ``e = topk_ids[t, k]``: ``h = W13[e] x[t] + b13[e]``, ``a =
    clamped_swiglu_interleaved(h, alpha, limit)``, ``y = W2[e] a + b2[e]``; the output is
    ``sum_k topk_weights[t, k] * y`` accumulated in float32, returned ``[T, H]`` in x's dtype
    (float32, bfloat16 or float16). ``topk_ids`` / ``expert_map`` / ``backend`` as in
    ``fused_moe``."""
    backend = _resolve_backend(backend, x)
    if backend == "triton":
        from llm_kernels import triton_mxfp4_moe

        return triton_mxfp4_moe.fused_moe_mxfp4_triton(
            x, experts, topk_weights, topk_ids, alpha=alpha, limit=limit, expert_map=expert_map
        )
    return moe_mxfp4_torch(
        x, experts, topk_weights, topk_ids, alpha=alpha, limit=limit, expert_map=expert_map
    )


def moe_mxfp4_torch(
    x: Tensor,
    experts: Mxfp4Experts,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    alpha: float,
    limit: float,
    expert_map: Tensor | None = None,
) -> Tensor:
    """``fused_moe_mxfp4``'s contract in torch: each active expert dequantized into x's dtype
    (exactly the dense weights the CPU loader makes), matmuls, biases and the activation in
    x's dtype as HF's gpt-oss does, the weighted sum in float32."""
    check_moe_inputs(x, topk_weights, topk_ids)
    experts.check(x)

    def expert_mlp(expert: int, rows: Tensor) -> Tensor:
        w13, w2 = experts.dense(expert, x.dtype)
        b13 = None if experts.w13_bias is None else experts.w13_bias[expert].to(x.dtype)
        b2 = None if experts.w2_bias is None else experts.w2_bias[expert].to(x.dtype)
        h = torch.nn.functional.linear(rows, w13, b13)
        return torch.nn.functional.linear(clamped_swiglu_interleaved(h, alpha, limit), w2, b2)

    return _grouped_by_expert(
        x, topk_weights, topk_ids, expert_map, experts.num_experts, expert_mlp
    )
