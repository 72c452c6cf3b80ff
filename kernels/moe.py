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

``fused_moe_mxfp4`` is the same for experts kept in MXFP4 (:class:`Mxfp4Experts`, gpt-oss's
checkpoint layout: gate and up rows interleaved, per-expert biases) with gpt-oss's clamped
SwiGLU; the Triton kernel (``kernels.triton_mxfp4_moe``) dequantizes inside the GEMMs, the
torch path dequantizes each active expert (a reference, and the fallback off CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.backend import triton_available
from kernels.mxfp4 import VALUES_PER_SCALE, check_mxfp4, dequantize_mxfp4
from kernels.ops import silu_and_mul

__all__ = [
    "MOE_BACKENDS",
    "Mxfp4Experts",
    "check_moe_args",
    "check_moe_inputs",
    "clamped_swiglu_interleaved",
    "fused_moe",
    "fused_moe_mxfp4",
    "local_expert_ids",
    "moe_mxfp4_torch",
    "moe_torch",
]

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


@dataclass(frozen=True)
class Mxfp4Experts:
    """One rank's experts in MXFP4 (``kernels.mxfp4``), in the checkpoint's layout::

        w13_blocks [E, 2I, H/32, 16]  w13_scales [E, 2I, H/32]   row 2j: gate j, 2j + 1: up j
        w13_bias   [E, 2I]            interleaved alike (None: no bias)
        w2_blocks  [E, H, G, 16]      w2_scales  [E, H, G]       input i at position
                                                                  w2_offset + i of a row
        w2_bias    [E, H]             (None: no bias)

    Under TP a rank holds a run of 2I / tp interleaved rows of w13 and, of w2, the groups that
    cover its I / tp inputs; ``w2_offset`` (< 32) is where they start in the first group."""

    w13_blocks: Tensor
    w13_scales: Tensor
    w13_bias: Tensor | None
    w2_blocks: Tensor
    w2_scales: Tensor
    w2_bias: Tensor | None
    w2_offset: int = 0

    @property
    def num_experts(self) -> int:
        return self.w13_blocks.shape[0]

    @property
    def intermediate(self) -> int:
        return self.w13_blocks.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.w2_blocks.shape[1]

    def check(self, x: Tensor) -> None:
        """Shapes, dtypes and devices against ``x [T, H]``; ValueError names the tensor."""
        check_mxfp4(self.w13_blocks, self.w13_scales, "w13")
        check_mxfp4(self.w2_blocks, self.w2_scales, "w2")
        e, two_i, groups, _ = self.w13_blocks.shape
        hidden = x.shape[1]
        if two_i % 2 or groups * VALUES_PER_SCALE != hidden:
            raise ValueError(
                f"w13_blocks must be [experts, 2 * intermediate, {hidden // VALUES_PER_SCALE}, 16] "
                f"for x's hidden size {hidden}, got {list(self.w13_blocks.shape)}"
            )
        covered = self.w2_offset + self.intermediate
        need = -(-covered // VALUES_PER_SCALE)
        if not 0 <= self.w2_offset < VALUES_PER_SCALE:
            raise ValueError(f"w2_offset must be in [0, 32), got {self.w2_offset}")
        if tuple(self.w2_blocks.shape[:3]) != (e, hidden, need):
            raise ValueError(
                f"w2_blocks must be [{e}, {hidden}, {need}, 16] to hold inputs "
                f"[{self.w2_offset}, {covered}) of its rows, got {list(self.w2_blocks.shape)}"
            )
        for name, bias, shape in (
            ("w13_bias", self.w13_bias, (e, two_i)),
            ("w2_bias", self.w2_bias, (e, hidden)),
        ):
            if bias is not None and tuple(bias.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)}, got {list(bias.shape)}")
        for name, t in vars(self).items():
            if isinstance(t, Tensor) and t.device != x.device:
                raise ValueError(f"{name} is on {t.device}, x on {x.device}")

    def dense(self, expert: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Expert ``expert``'s (w13 [2I, H], w2 [H, I]) dequantized into ``dtype``."""
        w13 = dequantize_mxfp4(self.w13_blocks[expert], self.w13_scales[expert], dtype)
        w2 = dequantize_mxfp4(self.w2_blocks[expert], self.w2_scales[expert], dtype)
        return w13, w2[:, self.w2_offset : self.w2_offset + self.intermediate]


def clamped_swiglu_interleaved(h: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's activation of ``h [..., 2I]`` with gate and up interleaved: ``(clamp(up,
    ±limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``, in h's dtype."""
    gate = h[..., 0::2].clamp(max=limit)
    up = h[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


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
    if backend not in MOE_BACKENDS:
        raise ValueError(f"backend must be one of {MOE_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if x.device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        from kernels import triton_mxfp4_moe

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
    check_moe_inputs(x, topk_weights, topk_ids)
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


def check_moe_inputs(x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> None:
    """``x`` and the routing of any fused-MoE entry point; ValueError names the first bad one."""
    if x.dim() != 2 or x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"x must be [tokens, hidden] float32/bfloat16/float16, got {x.dtype} {list(x.shape)}"
        )
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
