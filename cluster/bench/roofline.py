"""The throughput benchmark's roofline: the FLOPs the engine must do for a workload (decoder
matmuls, LM head, attention) and the dense-GEMM FLOP/s this machine reaches, measured in the
same run, so the achieved fraction says how far the engine is from the hardware.
"""

from __future__ import annotations

import time

import torch

from cluster.bench.model_shape import ModelShape
from cluster.bench.workload import Workload


def measure_gemm_flops(
    dtype: torch.dtype, device: str, n: int = 2048, seconds: float = 2.0
) -> float:
    """Dense n x n x n matmul FLOP/s on this machine (the roofline's compute ceiling)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(2):
        a @ b
    _sync(device)
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    _sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - start)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine_flops(shape: ModelShape, wl: Workload) -> float:
    """FLOPs the engine must do: every computed token through the decoder matmuls, the LM head
    for every sampled token, and attention (QK^T and AV) over each token's context."""
    per_token = 2 * shape.linear_params_per_token()
    lm_head = 2 * shape.vocab_size * shape.hidden_size
    attn_per_position = shape.attention_flops_per_position()
    total = 0.0
    for prompt, out in zip(wl.prompts, wl.output_lens):
        computed = len(prompt) + out - 1  # the last sampled token is never fed back
        total += computed * per_token + out * lm_head
        total += attn_per_position * computed * (computed + 1) / 2
    return total
