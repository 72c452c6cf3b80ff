"""Serving smoke test without Ray (TP = 1): ``AsyncLLMEngine`` in this process, the engine core
on its own thread, streaming many concurrent requests the way the OpenAI front does.

    python -m benchmarks.serving_smoke --out serving_smoke.json [--model builtin:tiny-llama]

Checks (exit status 1 when one fails) and reports:
- every stream yields tokens step by step and ends with finish_reason "length";
- a stream closed early is aborted and, once everything finished, no KV block is held;
- the KV cache was sized by the worker's memory probe (no ``num_kv_blocks``);
and the time to first token and inter-token latency (median, p99) over the streams.

The HTTP layer (``cluster.api.openai_api``) needs FastAPI and pydantic, and its app lives in
``cluster/``; this drives the engine API that the app streams from.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cluster.bench.stats import percentile


async def stream_one(engine: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True)
    start = time.monotonic()
    times: list[float] = []
    tokens = 0
    reason = None
    async for item in engine.generate(prompt, params):
        if item.num_new_tokens:
            times.append(time.monotonic())
            tokens += item.num_new_tokens
        reason = item.finish_reason
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {
        "tokens": tokens,
        "items": len(times),
        "finish_reason": reason,
        "ttft_s": times[0] - start if times else None,
        "itl_s": gaps,
    }


async def abort_early(engine: Any, prompt: str) -> int:
    """Read three items of a long request, then close its stream (aborts it)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.8, max_tokens=1000, ignore_eos=True)
    seen = 0
    stream = engine.generate(prompt, params)
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.aclose()
    return seen


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.client.async_llm_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(
        model=args.model,
        max_num_seqs=args.concurrency,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    try:
        prompts = [f"request {i}: tell me about the number {i * 7}" for i in range(args.requests)]
        started = time.monotonic()
        aborted, *results = await asyncio.gather(
            abort_early(engine, "this one is closed after three items"),
            *(stream_one(engine, p, args.max_tokens) for p in prompts),
        )
        wall = time.monotonic() - started
        for _ in range(50):  # the abort lands within a step
            stats = await engine.get_stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                break
            await asyncio.sleep(0.05)
        worker = getattr(engine.engine.executor, "worker", None)
        budget = getattr(worker, "kv_budget", None)
    finally:
        engine.shutdown()
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    itls = [g for r in results for g in r["itl_s"]]
    checks = {
        "every_stream_finished_by_length": all(r["finish_reason"] == "length" for r in results),
        "every_stream_got_max_tokens": all(r["tokens"] == args.max_tokens for r in results),
        "streams_were_incremental": all(r["items"] > 1 for r in results),
        "aborted_stream_read_three_items": aborted == 3,
        "no_request_left_running": stats.num_running == 0 and stats.num_waiting == 0,
        "no_kv_block_held": stats.kv_usage == 0.0,
        "kv_cache_sized_by_probe": budget is not None or not torch.cuda.is_available(),
    }
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": args.model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": round(sum(r["tokens"] for r in results) / wall, 1),
        "ttft_s": {"median": statistics.median(ttfts), "p99": percentile(ttfts, 0.99)},
        "itl_s": {
            "median": statistics.median(itls) if itls else None,
            "p99": percentile(itls, 0.99),
        },
        "kv_budget": budget.describe() if budget is not None else None,
        "kv_total_blocks": stats.kv_total_blocks,
        "checks": checks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("serving_smoke.json"))
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32, help="max_num_seqs")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    failed = [name for name, ok in report["checks"].items() if not ok]
    if failed:
        print(f"serving smoke: FAILED {failed}", file=sys.stderr)
        return 1
    print(f"serving smoke: passed; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
