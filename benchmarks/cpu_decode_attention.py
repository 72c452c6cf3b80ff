"""CPU decode attention (a measurement, not a test): the native kernel (``llm_kernels.cpu_decode``)
against the torch path's gather + SDPA, one layer, in the same process.

    python benchmarks/cpu_decode_attention.py [--json out.json] [--iters 50] [--isa avx2]

Shapes: the serving benchmark's model (12 query heads, 4 kv heads, head_dim 64) and Llama-3-8B's
attention (32 / 8 / 128); batch {1, 16, 64} x context {64, 160, 512, 2048}; bf16 and fp32;
block_size 16 with the blocks drawn at random from a cache of 2x the blocks in use. Each row
gives the median time per call of both paths, the ratio, and the native kernel's achieved
bandwidth (K and V bytes of every request / time). Uses torch's thread count (OMP_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# The repository root first, so that the script runs from a checkout without an install.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm_kernels import attention, cpu_decode
from llm_kernels.attention_metadata import AttentionMetadata

SHAPES = {"llama110m": (12, 4, 64), "llama3-8b": (32, 8, 128)}
BATCHES = (1, 16, 64)
CONTEXTS = (64, 160, 512, 2048)
BLOCK_SIZE = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--isa", choices=cpu_decode.ISAS, default=None, help="a build (default: this CPU's best)"
    )
    args = parser.parse_args(argv)
    isa = args.isa or cpu_decode.native_isa()
    if isa is None or not cpu_decode.native_decode_available(isa):
        print("the native CPU decode kernel does not run here (see the log)", file=sys.stderr)
        return 1
    rows = []
    print(f"threads {torch.get_num_threads()}, native kernel built for {isa}")
    print(f"{'shape':>10} {'dtype':>8} {'batch':>5} {'ctx':>5} {'torch us':>9} "
          f"{'native us':>9} {'speedup':>7} {'GB/s':>6}")  # fmt: skip
    for shape_name, (num_heads, num_kv_heads, head_dim) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            for batch in BATCHES:
                for context in CONTEXTS:
                    row = _measure(
                        num_heads, num_kv_heads, head_dim, dtype, batch, context, args.iters, isa
                    )
                    row["shape"] = shape_name
                    rows.append(row)
                    cells = (
                        f"{shape_name:>10} {str(dtype)[6:]:>8} {batch:>5} {context:>5}",
                        f"{row['torch_us']:>9.0f} {row['native_us']:>9.0f}",
                        f"{row['speedup']:>7.2f} {row['native_gbps']:>6.1f}",
                    )
                    print(*cells, flush=True)
    if args.json is not None:
        record = {"threads": torch.get_num_threads(), "isa": isa, "rows": rows}
        args.json.write_text(json.dumps(record))
    return 0


def _measure(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    batch: int,
    context: int,
    iters: int,
    isa: str,
) -> dict:
    rng = np.random.default_rng(0)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = 2 * batch * blocks_per_seq
    table = rng.permutation(num_blocks)[: batch * blocks_per_seq].reshape(batch, blocks_per_seq)
    # Contexts spread over the last block, as in a decode batch.
    seq_lens = np.maximum(context - rng.integers(0, BLOCK_SIZE, batch), 1)
    metadata = AttentionMetadata.build(
        query_lens=np.ones(batch, dtype=np.int64),
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=np.zeros(batch, dtype=np.int64),
        block_size=BLOCK_SIZE,
        device=torch.device("cpu"),
    )
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim).to(dtype)
    query = torch.randn(batch, num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    kernel = functools.partial(cpu_decode.attend_decode, isa=isa)
    native_call = lambda: attention.paged_attention(  # noqa: E731
        query, cache, metadata, scale, decode_kernel=kernel
    )
    torch_call = lambda: attention.paged_attention(query, cache, metadata, scale)  # noqa: E731
    torch_us, native_us = _median_us(torch_call, iters), _median_us(native_call, iters)
    kv_bytes = 2 * int(seq_lens.sum()) * num_kv_heads * head_dim * cache.element_size()
    return {
        "dtype": str(dtype),
        "batch": batch,
        "context": context,
        "torch_us": torch_us,
        "native_us": native_us,
        "speedup": torch_us / native_us,
        "native_gbps": kv_bytes / native_us / 1e3,
    }


def _median_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


if __name__ == "__main__":
    raise SystemExit(main())
