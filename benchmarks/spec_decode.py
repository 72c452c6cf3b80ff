"""Speculative decoding (n-gram, draft model) against decoding without it: TPOT, TTFT and output
tok/s at concurrency 1, 8 and 64, greedy, on a workload whose outputs repeat their prompts.

The model is a random-weight Llama with HF's 0.02 init (``make_random_model``), whose greedy
outputs fall into loops after a few tokens: prompt lookup then proposes what the model really
emits, as on editing / extraction workloads with a trained model. Each condition runs the same
requests; concurrency c keeps c requests in flight (a new one starts when one ends). Greedy
outputs with and without speculation are compared token for token.

Draft-model conditions (``--methods``): ``draft_small``, a smaller random Llama with the same
vocabulary and tokenizer (``--draft-hidden-size``, ``--draft-layers``; its own random weights,
so its greedy tokens rarely match the target's: the cost of proposing and verifying with low
acceptance), ``draft_trunc``, the target's first ``--draft-layers`` layers with its embedding,
final norm and LM head (a layer-skip draft: smaller, and correlated with the target), and
``draft_self``, the target as its own draft (every proposal accepted under
greedy: the upper bound of a draft model, and its overhead, k + 1 draft passes per step).

    python benchmarks/spec_decode.py --json spec.json [--hidden-size 512 --layers 8]
        [--methods ngram,draft_small,draft_self]

Prints the conditions with the figures; ``--json`` also writes them for a script to read.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from engine.builtin.tiny_models import make_random_model
from engine.core.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

VOCAB = 256


def run_condition(
    model: Path, prompts: list[list[int]], concurrency: int, max_tokens: int, spec: Any
) -> dict[str, Any]:
    engine = LLMEngine.from_engine_args(
        model=str(model),
        device="cpu",
        num_kv_blocks=2048,
        max_model_len=1024,
        max_num_seqs=max(concurrency, 1),
        speculative_config=spec,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("warmup", {"prompt_token_ids": prompts[0]}, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.spec_decode_stats.reset()
    pending = list(enumerate(prompts))
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    ends: dict[str, float] = {}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(started) - len(ends) < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
            started[f"r{i}"] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                ends[out.request_id] = now
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    engine.shutdown()
    ids = sorted(tokens, key=lambda r: int(r[1:]))
    tpot = [(ends[r] - first[r]) / (len(tokens[r]) - 1) for r in ids]
    ttft = [first[r] - started[r] for r in ids]
    produced = sum(len(tokens[r]) for r in ids)
    result: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": len(ids),
        "output_tokens": produced,
        "wall_s": wall,
        "output_tokens_per_s": produced / wall,
        "mean_tpot_ms": 1e3 * statistics.fmean(tpot),
        "mean_ttft_ms": 1e3 * statistics.fmean(ttft),
        "tokens": [tokens[r] for r in ids],
    }
    if spec is not None:
        result["spec_decode"] = engine.spec_decode_stats.as_dict()
    return result


def run_vllm(python: str, model: Path, workload: dict[str, Any]) -> dict[str, Any]:
    """vLLM's CPU build on the same prompts, off and n-gram, in its own interpreter."""
    reference = workload.pop("reference")
    script = Path(__file__).with_name("spec_decode_vllm.py")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp) / "w.json", Path(tmp) / "r.json"
        spec_path.write_text(json.dumps(workload))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
        done = subprocess.run(
            [python, str(script), str(model), str(spec_path), str(result_path)],
            capture_output=True, text=True, env=env, timeout=3600,
        )  # fmt: skip
        if not result_path.exists():
            return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}"}
        result = json.loads(result_path.read_text())
    for c, row in result["rows"].items():
        for name, cell in row.items():
            if "tokens" in cell:
                cell["outputs_equal_engine"] = cell.pop("tokens") == reference[c]
            line = cell.get("error") or f"{cell['output_tokens_per_s']:7.1f} tok/s"
            print(f"vllm c={c:<3} {name:<6} {line}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="also run vLLM's CPU build on the same prompts (benchmarks/spec_decode_vllm.py "
        "under this interpreter, e.g. ~/.cache/llm-cluster-peers/vllm-cpu/bin/python)",
    )
    parser.add_argument(
        "--methods", default="ngram", help="of ngram, draft_small, draft_trunc, draft_self"
    )
    parser.add_argument("--draft-hidden-size", type=int, default=128)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model = make_random_model(
        Path(tempfile.mkdtemp()) / "m",
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=max(1, args.hidden_size // 128),
        intermediate_size=2 * args.hidden_size,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
    )
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}  # fmt: skip
    specs = _method_specs(args, model, spec)
    rng = random.Random(0)
    rows = []
    workload: dict[str, Any] = {"prompts": {}, "max_tokens": args.max_tokens,
                                "max_model_len": 1024, "speculative_config": spec}  # fmt: skip
    for c in (int(x) for x in args.concurrency.split(",")):
        n = max(4, c * args.requests_per_slot) if c > 1 else 4
        lens = [rng.randrange(16, 33) for _ in range(n)]
        prompts = [[rng.randrange(3, VOCAB) for _ in range(m)] for m in lens]
        workload["prompts"][str(c)] = prompts
        off = run_condition(model, prompts, c, args.max_tokens, None)
        reference = off.pop("tokens")
        workload.setdefault("reference", {})[str(c)] = reference
        row: dict[str, Any] = {"concurrency": c, "off": off}
        print(
            f"c={c:<3} off {off['output_tokens_per_s']:7.1f} tok/s TPOT "
            f"{off['mean_tpot_ms']:6.2f} ms",
            flush=True,
        )
        for name, method_spec in specs.items():
            on = run_condition(model, prompts, c, args.max_tokens, method_spec)
            on["outputs_equal"] = reference == on.pop("tokens")
            on["speedup_tok_s"] = on["output_tokens_per_s"] / off["output_tokens_per_s"]
            row[name] = on
            s = on["spec_decode"]
            print(
                f"      {name} k={args.k} {on['output_tokens_per_s']:7.1f} tok/s TPOT "
                f"{on['mean_tpot_ms']:6.2f} ms ({on['speedup_tok_s']:.2f}x) | accepted "
                f"{s['acceptance_rate']:.0%}, mean acceptance length "
                f"{s['mean_acceptance_length']:.2f} | equal {on['outputs_equal']}",
                flush=True,
            )
        rows.append(row)
    vllm = run_vllm(args.vllm_python, model, workload) if args.vllm_python else None
    report = {
        "conditions": {
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
            "device": "cpu",
            "dtype": "float32",
            "model": {"hidden_size": args.hidden_size, "layers": args.layers, "vocab": VOCAB},
            "max_tokens": args.max_tokens,
            "greedy": True,
            "speculative_config": {
                name: {k: v for k, v in sp.items() if k != "model"} for name, sp in specs.items()
            },
            "draft_small": {"hidden_size": args.draft_hidden_size, "layers": args.draft_layers},
        },
        "rows": rows,
        "vllm": vllm,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


def _method_specs(args: argparse.Namespace, model: Path, ngram: dict[str, Any]) -> dict[str, Any]:
    """The speculative_config of each condition asked for, by name."""
    specs: dict[str, Any] = {}
    for name in args.methods.split(","):
        if name == "ngram":
            specs[name] = ngram
        elif name == "draft_self":
            specs[name] = {"method": "draft_model", "model": str(model),
                           "num_speculative_tokens": args.k}  # fmt: skip
        elif name == "draft_small":
            draft = make_random_model(
                Path(tempfile.mkdtemp()) / "draft",
                hidden_size=args.draft_hidden_size,
                num_hidden_layers=args.draft_layers,
                num_attention_heads=max(1, args.draft_hidden_size // 64),
                num_key_value_heads=1,
                intermediate_size=2 * args.draft_hidden_size,
                vocab_size=VOCAB,
                max_position_embeddings=1024,
                seed=1,
            )
            specs[name] = {"method": "draft_model", "model": str(draft),
                           "num_speculative_tokens": args.k}  # fmt: skip
        elif name == "draft_trunc":
            draft = _truncated_copy(model, args.draft_layers)
            specs[name] = {"method": "draft_model", "model": str(draft),
                           "num_speculative_tokens": args.k}  # fmt: skip
        else:
            raise SystemExit(
                f"--methods: {name!r} is not one of ngram, draft_small, draft_trunc, draft_self"
            )
    return specs


def _truncated_copy(model: Path, layers: int) -> Path:
    """The checkpoint's first ``layers`` decoder layers, embedding, final norm and LM head."""
    from safetensors.torch import load_file, save_file

    out = Path(tempfile.mkdtemp()) / "trunc"
    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(out / "model.safetensors")
    kept = {
        name: t
        for name, t in weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    main()
