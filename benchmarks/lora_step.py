"""Cost of multi-LoRA serving: engine decode-step time of a batch with 0 / 1 / 4 adapters in
use vs the base model with ``enable_lora`` off, on the same random Llama and load.

Each condition adds ``--batch`` requests (same prompts, ``ignore_eos``; with N adapters the
requests take them round-robin), steps until every prompt is computed, then times ``--steps``
decode steps while all requests are still running. Adapters are random PEFT adapters of rank
``--rank`` on all seven decoder projections; ``max_loras`` is 4.

    python benchmarks/lora_step.py --json lora_step.json

Prints the conditions with the figures; ``--json`` also writes them for a script to read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from engine.builtin.catalog import make_tiny_lora
from engine.builtin.tiny_models import make_random_llama, materialize
from engine.core.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(args: argparse.Namespace) -> Path:
    name = f"bench-llama-h{args.hidden}-l{args.layers}-t2"
    return materialize(
        name,
        lambda out: make_random_llama(
            out,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 64,
            num_key_value_heads=max(1, args.hidden // 256),
            intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        ),
    )


def _adapters(model: Path, rank: int, count: int, root: Path) -> list[LoRARequest]:
    loras = []
    for i in range(count):
        path = make_tiny_lora(str(model), root / f"lora{i}", rank, MODULES, seed=i, scale=0.1)
        loras.append(LoRARequest(f"lora{i}", i + 1, str(path)))
    return loras


def _prepare(
    model: Path, args: argparse.Namespace, enable_lora: bool, loras: list[LoRARequest]
) -> LLMEngine:
    """An engine with ``--batch`` running requests, every prompt computed, warmed up."""
    kwargs: dict[str, Any] = {
        "model": str(model),
        "max_num_seqs": args.batch,
        "max_model_len": args.prompt_len + args.rounds * args.steps + 16,
    }
    if enable_lora:
        kwargs.update(enable_lora=True, max_loras=4, max_lora_rank=args.rank)
    engine = LLMEngine.from_engine_args(**kwargs)
    params = SamplingParams(temperature=0, max_tokens=args.rounds * args.steps + 8, ignore_eos=True)
    prompt = list(range(10, 10 + args.prompt_len))
    for i in range(args.batch):
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(str(i), prompt, params, lora_request=lora)
    requests = engine.scheduler.requests.values()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests):
        engine.step()
    for _ in range(2):  # warm-up decodes
        engine.step()
    return engine


def _time_steps(engine: LLMEngine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the conditions")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = _model(args)
    adapter_dir = tempfile.TemporaryDirectory(prefix="lora-step-")
    loras = _adapters(model, args.rank, 4, Path(adapter_dir.name))
    conditions = [(False, []), (True, []), (True, loras[:1]), (True, loras)]
    engines = [_prepare(model, args, on, used) for on, used in conditions]
    # Conditions take turns, round after round, so that a noisy neighbour on a shared machine
    # hits them alike; the figure is the median over all timed steps of a condition.
    times: list[list[float]] = [[] for _ in conditions]
    for _ in range(args.rounds):
        for i, engine in enumerate(engines):
            times[i].extend(_time_steps(engine, args.steps))
    for engine in engines:
        engine.shutdown()
    adapter_dir.cleanup()
    results = []
    for (on, used), ts in zip(conditions, times):
        median = statistics.median(ts)
        results.append(
            {
                "enable_lora": on,
                "num_adapters": len(used),
                "median_step_ms": median * 1e3,
                "min_step_ms": min(ts) * 1e3,
                "tokens_per_s": args.batch / median,
            }
        )
    base = results[0]["median_step_ms"]
    for r in results:
        r["vs_base"] = r["median_step_ms"] / base
    report = {
        "conditions": {
            "model": f"random Llama hidden {args.hidden}, {args.layers} layers, vocab 32000",
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "timed_decode_steps": args.steps * args.rounds,
            "lora_rank": args.rank,
            "lora_targets": MODULES,
            "max_loras": 4,
            "device": "cpu",
            "torch_threads": args.threads,
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "results": results,
    }
    print(json.dumps(report["conditions"]))
    print(f"{'condition':<28}{'median ms/step':>16}{'min ms':>8}{'tok/s':>8}{'vs base':>9}")
    for r in results:
        label = (
            "base (enable_lora off)"
            if not r["enable_lora"]
            else (f"enable_lora, {r['num_adapters']} adapters")
        )
        print(f"{label:<28}{r['median_step_ms']:>16.2f}{r['min_step_ms']:>8.2f}"
              f"{r['tokens_per_s']:>8.0f}"
              f"{r['vs_base']:>9.2f}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
