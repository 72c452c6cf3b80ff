"""Greedy agreement of the FP8 KV cache with the bf16 one (a measurement, not a test).

For each model, the same fixed prompt set is generated greedily twice in bf16, once with
``kv_cache_dtype="auto"`` (a bf16 cache) and once with ``"fp8"`` (scales 1.0: the tiny
models' checkpoints carry none), and the outputs are compared token by token:

    agree            % of prompts whose whole continuation is token-equal
    first divergence for prompts that differ: the output position of the first unequal token
                     (min / median / max), and the mean fraction of the continuation generated
                     before it (1.0 would be full agreement)
    capacity         KV blocks of each cache for the same cpu_kv_cache_space (fp8 / bf16)
    noise floor      the same comparison between the fp32 and the bf16 model (auto caches):
                     how far bf16 rounding alone moves these models' greedy paths
    teacher-forced   % of continuation positions where, fed the reference prompt +
                     continuation, the FP8-cache model's argmax is the reference token (and
                     the bf16 model's on the fp32 model's continuation): per-step agreement

    python benchmarks/fp8_kv_agreement.py [--models tiny-llama tiny-qwen3 tiny-gemma2]
        [--num-prompts 32] [--max-tokens 64] [--json out.json]

The built-in random tiny models (engine.builtin.tiny_models) stand in for a real checkpoint: their
logits are spread wider than HF's default init gives (top-1 minus top-2 gap median ~0.7), but
a random model has no confident continuations, so this is a pessimistic proxy for a trained
model's agreement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source


def prompts_for(vocab: int, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """Fixed random prompts with lengths spread over 4..400 tokens."""
    rng = random.Random(seed)
    lengths = [4 + (396 * i) // max(num_prompts - 1, 1) for i in range(num_prompts)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def generate(
    model: str, kv_cache_dtype: str, prompts, max_tokens: int, dtype: str = "bfloat16"
) -> tuple[list, int]:
    llm = LLM(
        str(resolve_model_source(f"builtin:{model}")),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        # Small enough that the pool, not max_num_seqs x max_model_len, bounds the blocks.
        cpu_kv_cache_space=0.002,
        max_num_seqs=len(prompts),
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm.llm_engine.get_kv_cache_stats().total


def teacher_forced_top1(
    model: str, kv_cache_dtype: str, dtype: str, prompts, continuations
) -> float:
    """% of continuation positions whose reference token is still the argmax when the whole
    reference (prompt + continuation) is fed as the prompt: per-step agreement, free of the
    way one early flip derails a whole greedy continuation."""
    llm = LLM(
        str(resolve_model_source(f"builtin:{model}")),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        cpu_kv_cache_space=0.05,
        max_num_seqs=len(prompts),
    )
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    full = [p + c for p, c in zip(prompts, continuations)]
    outs = llm.generate([{"prompt_token_ids": f} for f in full], params, use_tqdm=False)
    hits = total = 0
    for prompt, cont, out in zip(prompts, continuations, outs):
        for pos, token in enumerate(cont):
            entry = out.prompt_logprobs[len(prompt) + pos]
            hits += entry[token].rank == 1
            total += 1
    return round(100 * hits / total, 2)


def agreement(reference: list[list[int]], got: list[list[int]], max_tokens: int) -> dict:
    """% of token-equal continuations and where the others first differ."""
    divergences = []
    for ref, out in zip(reference, got):
        first = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), None)
        if first is not None:
            divergences.append(first)
    row: dict[str, Any] = {
        "agree_pct": round(100 * (len(reference) - len(divergences)) / len(reference), 1),
        "first_divergence": None,
    }
    if divergences:
        row["first_divergence"] = {
            "min": min(divergences),
            "median": statistics.median(divergences),
            "max": max(divergences),
            "mean_fraction_before": round(statistics.mean(divergences) / max_tokens, 3),
        }
    return row


def compare(model: str, num_prompts: int, max_tokens: int) -> dict[str, Any]:
    prompts = prompts_for(256, num_prompts)
    reference, bf16_blocks = generate(model, "auto", prompts, max_tokens)
    fp8, fp8_blocks = generate(model, "fp8", prompts, max_tokens)
    # The noise floor: how often bf16 itself keeps the fp32 model's greedy path.
    fp32, _ = generate(model, "auto", prompts, max_tokens, dtype="float32")
    return {
        "fp8_teacher_forced_top1_pct": teacher_forced_top1(
            model, "fp8", "bfloat16", prompts, reference
        ),
        "bf16_teacher_forced_top1_of_fp32_pct": teacher_forced_top1(
            model, "auto", "bfloat16", prompts, fp32
        ),
        "model": model,
        "prompts": num_prompts,
        "max_tokens": max_tokens,
        "fp8_vs_bf16_cache": agreement(reference, fp8, max_tokens),
        "bf16_vs_fp32_model": agreement(fp32, reference, max_tokens),
        "bf16_blocks": bf16_blocks,
        "fp8_blocks": fp8_blocks,
        "capacity_ratio": round(fp8_blocks / bf16_blocks, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "tiny-qwen3", "tiny-gemma2"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    conditions = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": torch.get_num_threads(),
        "torch": torch.__version__,
        "model_dtype": "bfloat16",
        "kv_scales": 1.0,
    }
    rows = [compare(m, args.num_prompts, args.max_tokens) for m in args.models]
    result = {"conditions": conditions, "results": rows}
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
