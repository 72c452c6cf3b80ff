"""Kernel benchmark (a measurement, not a test): decode attention's achieved memory bandwidth
and decode-step latency with and without CUDA graphs.

    python benchmarks/kernels.py --out kernels.json [--peak-gbps 3350] [--model builtin:tiny-llama]

1. Decode attention, Triton ``paged_attention``, batch {1, 16, 64, 256} x context {512, 2048,
   8192}, Llama-3-8B attention shape per layer (32 query heads, 8 kv heads, head_dim 128,
   bf16, block_size 16, shuffled blocks). Bandwidth = bytes read (every request's K and V
   plus the queries) / kernel time, reported as a fraction of the device's peak HBM bandwidth
   (from the table below by device name, or ``--peak-gbps``); plus an FP8 cache
   (``kv_cache_dtype="fp8"``, 1-byte K/V) at batch {16, 64} x context {2048, 8192}.
2. Decode-step latency of a whole model (default the built-in tiny Llama, which isolates launch
   overhead) with the Triton backend, ``enforce_eager`` True vs False, per batch size.
3. Quantized GEMMs (FP8 per-channel and block, W4A16) against bf16 at Llama-3-70B's TP-2 layer
   shapes: tokens/s and fractions of peak FLOPS and bandwidth (``benchmarks/quant_gemm.py``).

Times are CUDA-event medians after warm-up. Needs CUDA; without it, exits with a message.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# Peak HBM bandwidth in GB/s by a substring of torch.cuda.get_device_name().
PEAK_GBPS: dict[str, float] = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 80GB HBM3": 3350.0,
    "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0,
    "A100-SXM4-80GB": 2039.0,
    "A100-SXM4-40GB": 1555.0,
    "A100-PCIE-80GB": 1935.0,
    "A100-PCIE-40GB": 1555.0,
    "L40S": 864.0,
    "A10G": 600.0,
    "L4": 300.0,
}
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 2048, 8192)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("kernels.json"))
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the peak table")
    parser.add_argument("--model", default="builtin:tiny-llama", help="model for step latency")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name()
    peak = args.peak_gbps or _peak_from_table(device_name)
    conditions = {
        "device": device_name,
        "peak_gbps": peak,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "attention_shape": "32 q heads, 8 kv heads, head_dim 128, bf16, block_size 16",
        "iters": args.iters,
    }
    print(json.dumps(conditions, indent=2))
    attention_rows = [
        _bench_decode_attention(batch, context, peak, args.iters)
        for batch in BATCHES
        for context in CONTEXTS
    ]
    attention_rows += [
        _bench_decode_attention(batch, context, peak, args.iters, kv_fp8=True)
        for batch in (16, 64)
        for context in (2048, 8192)
    ]
    step_rows = _bench_decode_steps(args.model, args.iters)
    from benchmarks.quant_gemm import bench as bench_quant_gemm

    quant_rows = bench_quant_gemm(_cuda_time_ms, peak, iters=min(args.iters, 30))
    result = {
        "conditions": conditions,
        "decode_attention": attention_rows,
        "decode_step": step_rows,
        "quant_gemm": quant_rows,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


def _peak_from_table(device_name: str) -> float | None:
    for key, gbps in PEAK_GBPS.items():
        if key in device_name:
            return gbps
    print(f"no peak bandwidth known for {device_name!r}; pass --peak-gbps", file=sys.stderr)
    return None


def _triton_version() -> str:
    import triton

    return triton.__version__


def _cuda_time_ms(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _bench_decode_attention(
    batch: int, context: int, peak: float | None, iters: int, kv_fp8: bool = False
) -> dict:
    from llm_kernels.attention_metadata import AttentionMetadata
    from llm_kernels.triton_attention import paged_attention
    from llm_kernels.triton_common import choose_num_kv_splits

    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    dtype = torch.bfloat16
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn(
        (2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device="cuda"
    )
    if kv_fp8:  # kv_cache_dtype="fp8": 1 byte per K/V element, dequantized in the kernel
        kv_cache = kv_cache.to(torch.float8_e4m3fn)
    block_table = np.random.default_rng(0).permutation(num_blocks).astype(np.int32)
    metadata = AttentionMetadata.build(
        query_lens=np.ones(batch, dtype=np.int64),
        seq_lens=np.full(batch, context),
        block_table=block_table.reshape(batch, blocks_per_seq),
        slot_mapping=np.full(batch, -1),
        block_size=block_size,
        device=torch.device("cuda"),
    )
    query = torch.randn((batch, num_heads, head_dim), dtype=dtype, device="cuda")
    ms = _cuda_time_ms(lambda: paged_attention(query, kv_cache, metadata, head_dim**-0.5), iters)
    kv_bytes = 1 if kv_fp8 else 2
    bytes_read = (2 * batch * context * num_kv_heads * kv_bytes + batch * num_heads * 2) * head_dim
    gbps = bytes_read / (ms * 1e-3) / 1e9
    row = {
        "kv_cache_dtype": "fp8" if kv_fp8 else "bf16",
        "batch": batch,
        "context": context,
        "num_kv_splits": choose_num_kv_splits(metadata, num_kv_heads),
        "time_us": round(ms * 1e3, 2),
        "achieved_gbps": round(gbps, 1),
        "fraction_of_peak": round(gbps / peak, 3) if peak else None,
    }
    print(row)
    return row


def _bench_decode_steps(model: str, iters: int) -> list[dict]:
    """One decode step of ``batch`` requests with 128-token contexts, eager vs CUDA graphs."""
    from engine.config import EngineConfig
    from engine.worker.worker import Worker

    rows = []
    for enforce_eager in (True, False):
        config = EngineConfig.from_kwargs(
            model=model,
            device="cuda",
            attention_backend="triton",
            enforce_eager=enforce_eager,
            num_kv_blocks=4096,
            max_num_seqs=256,
        )
        worker = Worker(config)
        worker.init_device()
        worker.load_model()
        worker.initialize_cache(4096, 0)
        runner = worker.runner
        for batch in (1, 16, 64, 256):
            inputs = _decode_inputs(runner, config.cache.block_size, batch, context=128)

            def step(inputs=inputs, runner=runner) -> object:
                if runner.graph_runner is not None:
                    return runner.graph_runner.run(
                        inputs.input_ids, inputs.positions, inputs.metadata
                    )
                return runner.forward(inputs)

            ms = _cuda_time_ms(step, iters)
            row = {
                "model": model,
                "batch": batch,
                "cuda_graphs": runner.graph_runner is not None,
                "step_ms": round(ms, 4),
            }
            print(row)
            rows.append(row)
    return rows


def _decode_inputs(runner, block_size: int, batch: int, context: int):
    from engine.worker.step_inputs import StepInputs
    from llm_kernels.attention_metadata import AttentionMetadata

    blocks_per_seq = -(-context // block_size)
    block_table = np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)
    positions = np.full(batch, context - 1)
    slots = block_table[np.arange(batch), positions // block_size] * block_size
    slots = slots.astype(np.int64) + positions % block_size
    metadata = AttentionMetadata.build(
        query_lens=np.ones(batch, dtype=np.int64),
        seq_lens=np.full(batch, context),
        block_table=block_table,
        slot_mapping=slots,
        block_size=block_size,
        device=runner.device,
    )
    return StepInputs(
        input_ids=torch.zeros(batch, dtype=torch.int64, device=runner.device),
        positions=torch.from_numpy(positions.astype(np.int64)).to(runner.device),
        metadata=metadata,
        logits_indices=torch.arange(batch, device=runner.device),
    )


if __name__ == "__main__":
    sys.exit(main())
