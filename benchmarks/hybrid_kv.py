"""KV cache groups on a Gemma-3-shaped model: blocks per sequence, sequences that fit, and
long-context decode throughput.

The model is ``cluster bench throughput --family gemma3``'s random checkpoint
(``engine.builtin.tiny_models.make_random_model``: five sliding layers of window 1024 per full one)
at a small shape, so a 2-core CPU runs an 8k context. The engine is sized from
``--cpu-kv-cache-space``; the workers' answer in all-layer blocks is what one pool for every layer
(the engine before KV cache groups) would hold, and the group layout is what it holds now.

Measured, not computed: one ``--context``-token sequence is run to its end with the engine
stepped by hand, and each group's held blocks are read after every step (the most, and at the
end). Then ``--num-seqs`` sequences of ``--context`` tokens (prompt + ``--output-len``) decode
together: output tok/s of the decode phase (from the step where all prompts are computed).

    python -m benchmarks.hybrid_kv --json hybrid.json [--context 8192 --num-seqs 4]

Run it from another checkout to measure that engine (it reads groups only where they exist).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

from engine import LLM, SamplingParams
from engine.builtin.tiny_models import make_random_model


def build_model(args: argparse.Namespace) -> Path:
    out = Path(args.cache) / (
        f"bench-gemma3-h{args.hidden_size}-l{args.layers}-a{args.heads}-kv{args.kv_heads}"
    )
    if not (out / "config.json").exists():
        make_random_model(
            out,
            "gemma3",
            hidden_size=args.hidden_size,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            intermediate_size=2 * args.hidden_size,
            vocab_size=4096,
        )
    return out


def held_blocks(llm: LLM, request_id: str) -> list[int]:
    manager = llm.llm_engine.block_manager
    if hasattr(manager, "num_held_blocks"):
        return manager.num_held_blocks(request_id)
    return [len(manager.get_block_ids(request_id))]


def one_sequence(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    """Held blocks per group while one sequence grows to ``--context`` tokens."""
    engine = llm.llm_engine
    rng = random.Random(0)
    prompt = [rng.randrange(5, 4096) for _ in range(args.context - args.output_len)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine.add_request("probe", {"prompt_token_ids": prompt}, params)
    most: list[int] = []
    last: list[int] = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.scheduler.requests.get("probe") is None:
            break
        last = held_blocks(llm, "probe")
        most = [max(a, b) for a, b in zip(most or last, last)]
    return {"most_held_blocks": most, "held_blocks_at_end": last}


def decode_throughput(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    engine = llm.llm_engine
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_seqs):
        prompt = [rng.randrange(5, 4096) for _ in range(args.context - args.output_len)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    start = time.perf_counter()
    decode_start = None
    tokens = 0
    most_running = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        running = engine.scheduler.running
        most_running = max(most_running, len(running))
        if (
            decode_start is None
            and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
            and not engine.scheduler.waiting
        ):
            decode_start, tokens = time.perf_counter(), 0
        tokens += sum(1 for o in outputs if o.outputs)
    end = time.perf_counter()
    decode_s = end - (decode_start or start)
    return {
        "wall_s": round(end - start, 2),
        "decode_s": round(decode_s, 2),
        "decode_out_tok_per_s": round(tokens / decode_s, 2) if decode_s else None,
        "most_running": most_running,
        "preemptions": engine.scheduler.num_preemptions,
    }


def capacity(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    engine = llm.llm_engine
    manager = engine.block_manager
    per_seq_full = -(-args.context // args.block_size)
    one_pool = engine.executor.determine_num_available_blocks()[0]
    out: dict[str, Any] = {
        "all_layer_blocks": one_pool,
        "one_pool_sequences": one_pool // per_seq_full,
    }
    layout = getattr(manager, "layout", None)
    if layout is not None:
        out["groups"] = [
            {"sliding_window": s.sliding_window, "blocks": n}
            for s, n in zip(layout.specs, layout.num_blocks)
        ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--cpu-kv-cache-space", type=float, default=0.25)
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/llm-cluster-bench"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(
        str(build_model(args)),
        device="cpu",
        dtype="float32",
        max_model_len=args.context,
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cpu_kv_cache_space=args.cpu_kv_cache_space,
        enable_prefix_caching=False,
        block_size=args.block_size,
    )
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "conditions": vars(args),
        "capacity": capacity(llm, args),
        "one_sequence": one_sequence(llm, args),
        "decode": decode_throughput(llm, args),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
