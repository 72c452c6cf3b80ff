"""Quantized GEMMs against bf16 at Llama-3-70B's layer shapes under TP 2 (one rank's qkv_proj,
o_proj, gate_up_proj, down_proj): ``F.linear`` in bf16, ``fp8_linear`` per-channel
(torch._scaled_mm, dynamic per-token activations, their quantization included), ``fp8_linear``
with 128x128 block scales (the Triton kernel) and ``w4a16_linear`` group 128 (the Triton
kernel), for M = 1, 16, 256 and 4096 tokens.

Per row: median time (CUDA events), tokens/s (M / time), achieved TFLOPS (2MNK / time) and its
fraction of the device's dense tensor-core peak for the operand type (bf16 for bf16 and W4A16,
FP8 for FP8), and weight bandwidth (weight bytes / time) as a fraction of HBM peak, which is
what bounds the small-M (decode) rows. Run through ``benchmarks/kernels.py`` (its
``quant_gemm`` section) or alone:

    python -m benchmarks.quant_gemm [--iters 30] [--out quant_gemm.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm_kernels.kv_quant import FP8_DTYPE
from llm_kernels.quant_gemm import fp8_linear, pack_int4, w4a16_linear

# One TP-2 rank of Llama-3-70B (hidden 8192, intermediate 28672, 64 q / 8 kv heads of 128).
LAYERS = (("qkv_proj", 5120, 8192), ("o_proj", 8192, 4096),
          ("gate_up_proj", 28672, 8192), ("down_proj", 8192, 14336))  # fmt: skip
TOKENS = (1, 16, 256, 4096)
# Dense tensor-core TFLOPS (bf16, fp8) by a substring of the device name (no sparsity).
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H200": (989.0, 1979.0),
    "H100 SXM": (989.0, 1979.0),
    "H100 80GB HBM3": (989.0, 1979.0),
    "H100 PCIe": (756.0, 1513.0),
    "H100 NVL": (835.0, 1671.0),
    "L40S": (362.0, 733.0),
    "L4": (121.0, 242.0),
    "A100": (312.0, 0.0),
}


def bench(
    time_ms: Callable[[Callable[[], object], int], float],
    peak_gbps: float | None,
    iters: int = 30,
) -> list[dict]:
    name = torch.cuda.get_device_name()
    bf16_peak, fp8_peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), (None, None))
    rows = []
    fp8_ok = torch.cuda.get_device_capability() >= (8, 9)
    for layer, n, k in LAYERS:
        # Below sm_89 fp8_linear is its torch reference: not worth timing.
        variants = {v: spec for v, spec in _variants(n, k).items() if fp8_ok or not spec[2]}
        for m in TOKENS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for variant, (fn, weight_bytes, fp8) in variants.items():
                ms = time_ms(lambda fn=fn, x=x: fn(x), iters)
                tflops = 2 * m * n * k / (ms * 1e-3) / 1e12
                gbps = weight_bytes / (ms * 1e-3) / 1e9
                peak = fp8_peak if fp8 else bf16_peak
                row = {
                    "layer": layer, "n": n, "k": k, "tokens": m, "kernel": variant,
                    "time_us": round(ms * 1e3, 1),
                    "tokens_per_s": round(m / (ms * 1e-3)),
                    "tflops": round(tflops, 1),
                    "fraction_of_peak_flops": round(tflops / peak, 3) if peak else None,
                    "weight_gbps": round(gbps, 1),
                    "fraction_of_peak_bandwidth": round(gbps / peak_gbps, 3) if peak_gbps else None,
                }  # fmt: skip
                print(row)
                rows.append(row)
    return rows


def _variants(n: int, k: int) -> dict[str, tuple[Callable, int, bool]]:
    """kernel name -> (x -> output, weight bytes read, whether it computes in FP8)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w_fp8 = (w_bf16.float() * 1e4).clamp(-448, 448).to(FP8_DTYPE)
    channel_scale = torch.full((n, 1), 1e-4, device="cuda")
    block_scale = torch.full((n // 128, k // 128), 1e-4, device="cuda")
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device="cuda")
    packed = pack_int4(q)
    group_scale = torch.full((n, k // 128), 0.01, device="cuda", dtype=torch.bfloat16)
    return {
        "bf16": (lambda x: F.linear(x, w_bf16), n * k * 2, False),
        "fp8_channel_scaled_mm": (
            lambda x: fp8_linear(x, w_fp8, channel_scale, out_dtype=torch.bfloat16),
            n * k,
            True,
        ),
        "fp8_block128_triton": (
            lambda x: fp8_linear(x, w_fp8, block_scale, (128, 128), out_dtype=torch.bfloat16),
            n * k,
            True,
        ),
        "w4a16_g128_triton": (
            lambda x: w4a16_linear(x, packed, group_scale, None, 128),
            n * k // 2 + group_scale.numel() * 2,
            False,
        ),
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.kernels import PEAK_GBPS, _cuda_time_ms

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("quant_gemm.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/quant_gemm.py needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    peak_gbps = next((v for k, v in PEAK_GBPS.items() if k in name), None)
    rows = bench(_cuda_time_ms, peak_gbps, args.iters)
    args.out.write_text(json.dumps({"device": name, "quant_gemm": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
