"""Offline engine throughput without Ray (a measurement, not a test): ``LLM.generate`` in this
process, on a random-weight checkpoint or a model directory, with the workload of
``cluster bench throughput`` and ``../shared/peers/offline_bench.py`` (N prompts of random token
ids, lengths uniform in ranges, ``ignore_eos``, fixed seed).

    python -m benchmarks.engine_throughput --out engine_throughput.json [--model DIR]
        [--num-prompts 256] [--input-len 64:256] [--output-len 128:256] [--compare-eager]

Reports, after an untimed warm-up:
- throughput (output and total tokens/s) with no device syncs but the sampler's (the way it
  serves), for CUDA graphs on and, with ``--compare-eager``, off;
- a step profile from a second, device-synchronized pass (``reset_step_timings(
  device_sync=True)``: every phase boundary waits for the GPU, so each phase holds its own
  device time; that pass is slower and its wall time is not the throughput figure);
- the worker's KV budget (``engine.worker.kv_sizing``) and the number of KV blocks.

Works on CPU too (small defaults), where there is nothing to synchronize.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

# A ~1.1B-parameter Llama on a GPU (weights-bound decode, as a served model), a small one on CPU.
GPU_SHAPE = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "intermediate_size": 5632,
    "vocab_size": 32000,
}
CPU_SHAPE = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "vocab_size": 32000,
}


def workload(
    n: int, inp: tuple[int, int], out: tuple[int, int], vocab: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    """The same generator as ``offline_bench.py`` (same seed, same prompts)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(*inp))] for _ in range(n)]
    return prompts, [rng.randint(*out) for _ in range(n)]


def length_range(text: str) -> tuple[int, int]:
    low, high = text.split(":")
    return int(low), int(high)


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("engine_throughput.json"))
    parser.add_argument("--model", default=None, help="HF model directory (default: random)")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--num-prompts", type=int, default=256 if cuda else 16)
    parser.add_argument("--input-len", type=length_range, default=(64, 256) if cuda else (16, 64))
    parser.add_argument("--output-len", type=length_range, default=(128, 256) if cuda else (16, 32))
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-eager", action="store_true", help="also enforce_eager=True")
    parser.add_argument("--no-profile", action="store_true", help="skip the synced step profile")
    parser.add_argument(
        "--system",
        choices=("engine", "vllm"),
        default="engine",
        help="vllm: the peer engine on the same checkpoint and workload (needs vllm importable)",
    )
    args = parser.parse_args(argv)

    from engine.builtin.tiny_models import make_random_model, materialize

    shape = GPU_SHAPE if cuda else CPU_SHAPE
    if args.model:
        model_dir = Path(args.model)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    else:
        name = "bench-llama-" + "-".join(str(v) for v in shape.values())
        model_dir = materialize(name, lambda out: make_random_model(out, "llama", **shape))
        vocab = shape["vocab_size"]
    prompts, output_lens = workload(
        args.num_prompts, args.input_len, args.output_len, vocab, args.seed
    )
    runs = [False, True] if args.compare_eager else [False]
    run = run_engine if args.system == "engine" else run_vllm
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": str(model_dir),
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "input_len": list(args.input_len),
        "output_len": list(args.output_len),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "system": args.system,
        "runs": [],
    }
    failed = False
    for enforce_eager in runs:
        try:
            result = run(args, model_dir, prompts, output_lens, enforce_eager)
        except Exception as exc:  # recorded, so that the other run still reports
            traceback.print_exc()
            result = {"enforce_eager": enforce_eager, "error": f"{type(exc).__name__}: {exc}"}
            failed = True
        print(json.dumps(result), flush=True)
        report["runs"].append(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if failed else 0


def run_engine(
    args: argparse.Namespace,
    model_dir: Path,
    prompts: list[list[int]],
    output_lens: list[int],
    enforce_eager: bool,
) -> dict[str, Any]:
    from engine import LLM, SamplingParams

    max_len = max(map(len, prompts)) + max(output_lens)
    started = time.perf_counter()
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=enforce_eager,
        seed=args.seed,
    )
    startup_s = time.perf_counter() - started
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n)
        for n in output_lens
    ]
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests[:2], params[:2], use_tqdm=False)  # warm-up, untimed
    engine = llm.llm_engine
    executor = engine.executor
    executor.collective_rpc("reset_step_timings", (False,))
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    wall = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != sum(output_lens):
        raise RuntimeError(f"produced {produced} tokens, expected {sum(output_lens)}")
    worker = getattr(executor, "worker", None)
    budget = getattr(worker, "kv_budget", None)
    result: dict[str, Any] = {
        "enforce_eager": enforce_eager,
        "cuda_graphs": bool(worker and worker.runner.graph_runner is not None),
        "startup_s": round(startup_s, 2),
        "wall_s": round(wall, 3),
        "output_tokens": produced,
        "output_tok_s": round(produced / wall, 1),
        "total_tok_s": round((produced + sum(map(len, prompts))) / wall, 1),
        "num_kv_blocks": engine.block_manager.num_blocks,
        "kv_budget": budget.describe() if budget is not None else None,
    }
    if not args.no_profile:
        result["step_profile_synced"] = synced_profile(llm, requests, params)
    del llm, engine, executor, worker
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def run_vllm(
    args: argparse.Namespace,
    model_dir: Path,
    prompts: list[list[int]],
    output_lens: list[int],
    enforce_eager: bool,
) -> dict[str, Any]:
    """vLLM's offline ``LLM.generate`` with the same limits, workload and sampling."""
    import vllm
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = vllm.LLM(
        model=str(model_dir),
        dtype=args.dtype,
        max_model_len=max(map(len, prompts)) + max(output_lens),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=enforce_eager,
        seed=args.seed,
        skip_tokenizer_init=True,
    )
    startup_s = time.perf_counter() - started
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [
        vllm.SamplingParams(
            temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n, detokenize=False
        )
        for n in output_lens
    ]
    llm.generate(requests[:2], params[:2], use_tqdm=False)  # warm-up, untimed
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    wall = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "system": "vllm",
        "vllm": vllm.__version__,
        "enforce_eager": enforce_eager,
        "startup_s": round(startup_s, 2),
        "wall_s": round(wall, 3),
        "output_tokens": produced,
        "output_tok_s": round(produced / wall, 1),
        "total_tok_s": round((produced + sum(map(len, prompts))) / wall, 1),
    }


def synced_profile(llm: Any, requests: list[Any], params: list[Any]) -> dict[str, Any]:
    """Seconds per phase over one more pass with a device sync at every phase boundary."""
    engine = llm.llm_engine
    engine.step_timer.reset()
    engine.executor.collective_rpc("reset_step_timings", (True,))
    start = time.perf_counter()
    llm.generate(requests, params, use_tqdm=False)
    wall = time.perf_counter() - start
    worker = engine.executor.collective_rpc("step_timings")[0]
    engine.executor.collective_rpc("reset_step_timings", (False,))
    head = dict(engine.step_timer.totals)
    phases = {
        "schedule": head.get("schedule", 0.0),
        "prepare_inputs": worker.get("prepare_inputs", 0.0),
        "forward": worker.get("forward", 0.0),
        "lm_head": worker.get("lm_head", 0.0),
        "sample": worker.get("sample", 0.0),
        "update": head.get("update", 0.0),
    }
    return {
        "wall_s": round(wall, 3),
        "seconds": {k: round(v, 4) for k, v in phases.items()},
        "fraction": {k: round(v / wall, 4) for k, v in phases.items()},
    }


if __name__ == "__main__":
    sys.exit(main())
