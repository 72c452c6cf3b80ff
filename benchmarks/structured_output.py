"""Cost of structured outputs: engine decode-step time with half the batch JSON-constrained vs
none, on the same model and load; and the head's per-token grammar cost (fill the next-token
bitmask + accept the sampled token).

Each condition adds ``--batch`` requests (same prompts, ``ignore_eos``), steps until every
prompt is computed, then times ``--steps`` decode steps while all requests are still running
(the schema's shortest document is longer than that, so no constrained request ends early).

    python benchmarks/structured_output.py --model builtin:tiny-llama --batch 16 --json out.json

Prints the conditions with the figures; ``--json`` also writes them for a script to read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import xgrammar as xgr

from engine.core.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
STRUCTURED = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


def _params(constrained: bool, seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        ignore_eos=True,
        structured_outputs=STRUCTURED if constrained else None,
    )


def time_decode_steps(
    engine: LLMEngine, batch: int, num_constrained: int, steps: int, tag: str
) -> dict[str, float]:
    for i in range(batch):
        prompt = f"Person {i}: describe them as JSON."
        engine.add_request(f"{tag}-{i}", prompt, _params(i < num_constrained, i, 4 * steps))
    while any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()
    ):
        engine.step()
    engine.step_timer.reset()
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        samples.append((time.perf_counter() - start) * 1e3)
        if len(engine.scheduler.running) != batch:
            raise RuntimeError("a request ended during the timed steps: lower --steps")
    schedule_ms = engine.step_timer.totals["schedule"] * 1e3 / steps
    engine.abort_request([f"{tag}-{i}" for i in range(batch)])
    return {
        "mean_step_ms": statistics.fmean(samples),
        "median_step_ms": statistics.median(samples),
        # Scheduling plus building the step message, the grammar bitmask included.
        "schedule_and_bitmask_ms": schedule_ms,
        "steps": steps,
    }


def time_grammar_per_token(engine: LLMEngine, documents: int) -> dict[str, float]:
    """Replay real constrained outputs through fresh matchers: fill + accept per token."""
    params = [_params(True, 1000 + i, 200) for i in range(documents)]
    for i, p in enumerate(params):
        engine.add_request(f"doc-{i}", "Describe a person as JSON.", p)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    manager = engine.structured_output
    bitmask = xgr.allocate_token_bitmask(1, manager.vocab_size)
    fill_s = accept_s = 0.0
    tokens = 0
    for token_ids in outputs.values():
        matcher = manager.new_grammar(STRUCTURED).matcher
        for token in token_ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            mid = time.perf_counter()
            if not matcher.accept_token(token):
                raise RuntimeError("replayed token rejected")
            fill_s += mid - start
            accept_s += time.perf_counter() - mid
            tokens += 1
    return {
        "tokens": tokens,
        "fill_next_token_bitmask_us": fill_s / tokens * 1e6,
        "accept_token_us": accept_s / tokens * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    engine = LLMEngine.from_engine_args(
        model=args.model, num_kv_blocks=64 * args.batch, max_num_seqs=args.batch
    )
    time_decode_steps(engine, args.batch, 0, 4, "warmup")
    none = time_decode_steps(engine, args.batch, 0, args.steps, "none")
    half = time_decode_steps(engine, args.batch, args.batch // 2, args.steps, "half")
    per_token = time_grammar_per_token(engine, args.documents)
    report = {
        "conditions": {
            "model": args.model,
            "vocab_size": engine.config.model.vocab_size,
            "batch": args.batch,
            "constrained_in_half": args.batch // 2,
            "decode_steps_timed": args.steps,
            "device": engine.config.device.device_type,
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "platform": platform.platform(),
            "schema": "nested object, bounded strings / arrays / integers, no whitespace",
        },
        "none_constrained": none,
        "half_constrained": half,
        "step_overhead_ratio": half["mean_step_ms"] / none["mean_step_ms"],
        "per_token": per_token,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    engine.shutdown()


if __name__ == "__main__":
    main()
