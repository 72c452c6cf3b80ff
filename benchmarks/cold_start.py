"""Cold start to first token: launch a server from nothing, time until its first streamed token.

For each system, each round starts a fresh server process on the bench checkpoint (a random
Llama written locally, ``engine.builtin.tiny_models.make_random_model``), polls ``GET /health``
until it answers 200 (``/v1/models`` is no sign: the ingress lists its models while they still
load), then sends one streaming completion and times its first token:

- ``cluster``: ``cluster serve CONFIG`` (a fresh local Ray, Serve, one replica, TP = 1);
- ``vllm``: ``vllm serve`` from the peer venv (``../shared/peers/setup-vllm-cpu.sh``), when present.

    python benchmarks/cold_start.py --rounds 2 --json out.json

Reported per system (median round): seconds from launch to ready (``/health`` is 200), to
the first token, and the first request's own TTFT; for ``cluster`` also the engine's start-up
timeline when its log prints one. The server is stopped (SIGINT, then SIGKILL) after each round.
Rounds alternate systems so that a drifting machine hurts both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PEER_VENV_DEFAULT = Path.home() / ".cache" / "llm-cluster-peers" / "vllm-cpu"
_READY_TIMEOUT_S = 600.0
_SHAPE_ARGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size")  # fmt: skip


def _free_port() -> int:
    """A spare port outside the OS's ephemeral range, where Ray's own servers take ports."""
    from cluster.ops.deploy import spare_port

    return spare_port()


def _bench_model(out: Path, args: argparse.Namespace) -> Path:
    from engine.builtin.tiny_models import make_random_model

    if not (out / "config.json").exists():
        make_random_model(
            out,
            hidden_size=args.hidden_size,
            num_hidden_layers=args.num_hidden_layers,
            num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_key_value_heads,
            intermediate_size=args.intermediate_size,
            vocab_size=args.vocab_size,
        )
    return out


def _cluster_command(model: Path, port: int, workdir: Path, args: argparse.Namespace) -> list[str]:
    import yaml

    config = {
        "models": [
            {
                "model_loading_config": {"model_id": "bench", "model_source": str(model)},
                "engine_kwargs": {
                    "device": "cpu",
                    "dtype": args.dtype,
                    "max_model_len": args.max_model_len,
                    "cpu_kv_cache_space": args.kv_cache_gib,
                },
                "deployment_config": {"num_replicas": 1},
            }
        ],
        "http_options": {"host": "127.0.0.1", "port": port},
        "grpc_options": {"port": _free_port()},
    }
    path = workdir / "cold-start.yaml"
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "cluster.cli", "serve", str(path)]


def _vllm_command(model: Path, port: int, args: argparse.Namespace) -> list[str] | None:
    vllm = Path(os.environ.get("PEER_VENV") or PEER_VENV_DEFAULT) / "bin" / "vllm"
    if not vllm.exists():
        return None
    return [str(vllm), "serve", str(model), "--served-model-name", "bench", "--dtype",
            args.dtype, "--max-model-len", str(args.max_model_len), "--port", str(port),
            "--host", "127.0.0.1"]  # fmt: skip


def _get(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _first_token_s(base: str) -> float:
    """Send one streaming completion; seconds until its first content chunk."""
    body = json.dumps({"model": "bench", "prompt": "Hello, my name is", "max_tokens": 8,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()  # fmt: skip
    request = urllib.request.Request(
        f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _timeline(log: str) -> str | None:
    match = re.search(r"engine ready in .*", log)
    return match.group(0) if match else None


def one_round(system: str, command: list[str], port: int, log_path: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    base = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
        try:
            while not _get(f"{base}/health"):
                if proc.poll() is not None:
                    raise RuntimeError(f"{system} exited with {proc.returncode}; see {log_path}")
                if time.perf_counter() - start > _READY_TIMEOUT_S:
                    raise RuntimeError(f"{system} not ready after {_READY_TIMEOUT_S:.0f} s")
                time.sleep(0.2)
            ready_s = time.perf_counter() - start
            ttft_s = _first_token_s(base)
            first_token_s = time.perf_counter() - start
        finally:
            _stop(proc)
    result: dict[str, Any] = {
        "ready_s": ready_s,
        "first_token_s": first_token_s,
        "first_request_ttft_s": ttft_s,
    }
    timeline = _timeline(log_path.read_text(errors="replace"))
    if timeline:
        result["engine_timeline"] = timeline
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="cluster,vllm")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-hidden-layers", type=int, default=12)
    parser.add_argument("--num-attention-heads", type=int, default=12)
    parser.add_argument("--num-key-value-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=1536)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a bench checkpoint")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="cold-start-"))
    model = _bench_model(args.model_dir or workdir / "model", args)
    results: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for system in args.systems.split(","):
            port = _free_port()
            if system == "cluster":
                command = _cluster_command(model, port, workdir, args)
            elif system == "vllm":
                command = _vllm_command(model, port, args)
                if command is None:
                    print("vllm: no peer venv (../shared/peers/setup-vllm-cpu.sh); skipped")
                    continue
            else:
                raise SystemExit(f"--systems: unknown system {system!r} (cluster, vllm)")
            log_path = workdir / f"{system}-{len(results.get(system, []))}.log"
            outcome = one_round(system, command, port, log_path)
            print(f"{system}: {json.dumps(outcome)}", flush=True)
            results.setdefault(system, []).append(outcome)
    report: dict[str, Any] = {
        "conditions": {
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "dtype": args.dtype,
            "model": {k: getattr(args, k) for k in _SHAPE_ARGS},
            "date": time.strftime("%Y-%m-%d"),
        },
        "rounds": results,
        "median": {
            system: {
                key: statistics.median(r[key] for r in rounds)
                for key in ("ready_s", "first_token_s", "first_request_ttft_s")
            }
            for system, rounds in results.items()
        },
    }
    for system, figures in report["median"].items():
        print(
            f"{system:8s} ready {figures['ready_s']:6.1f} s   first token "
            f"{figures['first_token_s']:6.1f} s   (first request's TTFT "
            f"{figures['first_request_ttft_s'] * 1e3:.0f} ms)"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
