"""Sleep mode against a cold start, on the engine (``docs/sleep_mode.md``).

One process, the bench checkpoint (a random Llama written locally, as ``cluster bench``
writes it): build the engine (what a new replica's engine does after its process and Ray are
up: weights, KV sizing and allocation), generate, then for each level sleep, measure the
resident memory freed and the time to wake, and generate again (tokens must be equal).

    python benchmarks/sleep_wake.py --model DIR [--dtype bfloat16] [--json out.json]

The engine's build time is a lower bound on a new replica's cold start (which adds Ray, Serve,
the process and its imports: ``benchmarks/cold_start.py``), so ``cold / wake`` here is a lower
bound on what sleeping saves.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import LLM, SamplingParams  # noqa: E402

PROMPTS = [{"prompt_token_ids": [10 + (13 * i + j) % 900 for j in range(64)]} for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    kwargs: dict[str, Any] = {"dtype": args.dtype, "max_model_len": 1024}
    if args.num_kv_blocks is not None:
        kwargs["num_kv_blocks"] = args.num_kv_blocks
    start = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    cold_s = time.perf_counter() - start
    expected = tokens(llm)
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "model": args.model, "dtype": args.dtype, "engine_build_s": round(cold_s, 3),
        "levels": {},
    }  # fmt: skip
    for level in (1, 2):
        awake = rss_bytes()
        started = time.perf_counter()
        llm.sleep(level)
        sleep_s = time.perf_counter() - started
        freed = awake - rss_bytes()
        started = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - started
        same = tokens(llm) == expected
        report["levels"][level] = {
            "sleep_s": round(sleep_s, 3), "wake_s": round(wake_s, 3),
            "rss_freed_mib": round(freed / 2**20, 1), "tokens_equal": same,
            "cold_over_wake": round(cold_s / wake_s, 1),
        }  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
