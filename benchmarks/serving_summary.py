"""The table of ``benchmarks/serving_paths.sh OUT``: every path's output tok/s (and its ratio to the
offline engine of the same run), TTFT / TPOT / ITL at 64 requests at once and at concurrency 1,
and the per-process CPU recorded during each saturating run (with the head's CPU per generated
token: its actor and its engine-core child, if any). Writes ``OUT/summary.json``.

    python benchmarks/serving_summary.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PATHS = ("baseline", "cluster", "cluster_variant", "cluster_proxy", "cluster_throughput", "vllm")
# The processes of a replica's head: its Ray actor (named by its current task, or by the actor
# name) and, when its engine core runs in a child process, that child.
HEAD_PROCESSES = ("ray::HeadActor", "ray::LLMHead", "llm-engine-core")


def _load(path: Path) -> dict[str, Any] | None:
    """A JSON file, or the last JSON line of one (vLLM's offline run logs to stdout too)."""
    if not path.is_file():
        return None
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads([line for line in text.splitlines() if line.startswith('{"')][-1])


def _client_row(out: Path, name: str) -> dict[str, float] | None:
    sat, one = _load(out / f"{name}.json"), _load(out / f"{name}_c1.json")
    if sat is None:
        return None
    row = {
        "out_tok_s": sat["output_throughput"],
        "ttft_p50_ms": sat["median_ttft_ms"],
        "tpot_p50_ms": sat["median_tpot_ms"],
        "itl_p99_ms": sat["p99_itl_ms"],
    }
    if one is not None:
        row |= {
            "c1_ttft_p50_ms": one["median_ttft_ms"],
            "c1_tpot_p50_ms": one["median_tpot_ms"],
            "c1_itl_p99_ms": one["p99_itl_ms"],
        }
    return row


def _top(out: Path, name: str) -> dict[str, float]:
    """%CPU per process name (summed), from the top snapshot of that path's saturating run."""
    path = out / f"top_{name}.txt"
    cpu: dict[str, float] = {}
    if not path.is_file():
        return cpu
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 12 and parts[0].isdigit():
            command = " ".join(parts[11:])
            cpu[command] = cpu.get(command, 0.0) + float(parts[8])
    return {k: v for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v >= 1.0}


def main(out: Path) -> dict[str, Any]:
    offline = {
        name: (_load(out / f"offline_{name}.json") or {}).get("out_tok_s")
        for name in ("engine", "vllm", "engine_after")
    }
    reference = offline["engine"]
    rows = {name: row for name in PATHS if (row := _client_row(out, name)) is not None}
    for suffix in ("", "_c1"):  # 64 at once; concurrency 1 (the in-process c=1 reference)
        compare = _load(out / f"compare{suffix}.json")
        if compare is None:
            continue
        for name, result in compare["results"].items():
            rows[f"compare{suffix}_{name}"] = {
                "out_tok_s": result["output_token_throughput"],
                "ttft_p50_ms": result["ttft_ms"]["p50"],
                "tpot_p50_ms": result["tpot_ms"]["p50"],
                "itl_p99_ms": result["itl_ms"]["p99"],
            }
    cpu_percent = {name: _top(out, name) for name in PATHS}
    for name, cpu in cpu_percent.items():
        head = sum(v for k, v in cpu.items() if k.startswith(HEAD_PROCESSES))
        if name in rows and head:
            # The profile's top snapshot is of the same load as the saturating run's rate.
            rows[name]["head_cpu_ms_per_token"] = head / 100 * 1000 / rows[name]["out_tok_s"]
    summary = {"offline_out_tok_s": offline, "paths": rows, "cpu_percent": cpu_percent}
    print(f"offline tok/s: engine {offline['engine']}, vLLM {offline['vllm']}, "
          f"engine again at the end {offline['engine_after']}")  # fmt: skip
    for name, row in rows.items():
        ratio = row["out_tok_s"] / reference if reference else float("nan")
        cells = "  ".join(f"{k} {v:.1f}" for k, v in row.items())
        print(f"{name:26s} {ratio:5.2f}x offline  {cells}")
    for name, cpu in summary["cpu_percent"].items():
        if cpu:
            print(f"CPU % during {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items()))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main(Path(sys.argv[1]))
