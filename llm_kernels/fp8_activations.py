"""FP8 activations for the W8A8 GEMMs: ``x`` quantized to ``float8_e4m3fn`` per token, per token
and group of K columns (block-scaled weights), or with a static per-tensor scale. Shared by the
torch reference and CUDA paths (``llm_kernels.quant_gemm``) and the Triton block GEMM
(``llm_kernels.triton_quant_gemm``), so that both quantize the same way.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from llm_kernels.kv_quant import FP8_DTYPE, FP8_E4M3_MAX

__all__ = ["expand_columns", "quantize_activations_fp8"]

# A token whose activations are all 0 gets this scale instead of 0 (no division by zero).
_MIN_ACTIVATION_SCALE = 1e-12


def quantize_activations_fp8(
    x: Tensor, input_scale: Tensor | None = None, group: int | None = None
) -> tuple[Tensor, Tensor]:
    """``x [M, K]`` as float8_e4m3fn and its float32 scales: ``[1, 1]`` for a static
    ``input_scale``, else dynamic ``[M, 1]`` per token or ``[M, ceil(K / group)]`` per token
    and group of K (max |x| / 448, so each token's largest value maps to 448)."""
    x32 = x.to(torch.float32)
    if input_scale is not None:
        scale = input_scale.to(device=x.device, dtype=torch.float32).reshape(1, 1)
    elif group is None:
        scale = x32.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX
    else:
        groups = math.ceil(x.shape[1] / group)
        padded = torch.nn.functional.pad(x32.abs(), (0, groups * group - x.shape[1]))
        scale = padded.view(x.shape[0], groups, group).amax(dim=2) / FP8_E4M3_MAX
    scale = scale.clamp(min=_MIN_ACTIVATION_SCALE)
    scaled = x32 / expand_columns(scale, group, x.shape[1])
    return scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE), scale


def expand_columns(scale: Tensor, group: int | None, k: int) -> Tensor:
    """Per-group scales ``[M, G]`` repeated over each group's columns ``[M, K]``; other scales
    broadcast as they are."""
    if group is None:
        return scale
    return scale.repeat_interleave(group, dim=1)[:, :k]
