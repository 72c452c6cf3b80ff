"""``cluster bench throughput``: offline throughput of this engine against HF transformers and
vLLM (the bench model's families and shapes are ``cluster.bench.model_shape``).

Workload as in vLLM's and nano-vllm's throughput benchmarks: N prompts of random token ids,
input and output lengths uniform in ranges, ``ignore_eos``, fixed seed. Throughput = output
tokens / wall time (prefill included). Every system runs in this process on the same weights,
workload and dtype, one after another, each after a short warm-up that is not timed:
``engine``, ``engine_unpipelined`` / ``engine_even_split`` (PP > 1), ``hf_static``, ``hf_cb``
and, when asked for, ``vllm`` in its own venv (``run`` says what each is).

``--rounds N`` runs the systems N times in turn (engine, vllm, engine, vllm, ...) and reports each
system's median round, so that a machine drifting during the run hurts every system alike.

The roofline (``cluster.bench.roofline``) compares the engine's achieved FLOP/s with a dense
GEMM measured in the same run; the HF baselines are ``cluster.bench.hf_baselines``, the
workload ``cluster.bench.workload``. The step profile says where the engine's time
goes (scheduler, input preparation, forward, sampling, detokenization).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from cluster.bench.hf_baselines import load_hf, run_hf_cb, run_hf_static
from cluster.bench.model_shape import (
    ModelShape,
    add_shape_arguments,
    bench_model_builder,
    shape_from_args,
)
from cluster.bench.roofline import engine_flops, measure_gemm_flops
from cluster.bench.workload import SystemResult, Workload, make_workload, token_range
from engine import envs
from engine.pp_partition import balanced_partition, layer_partition, requested_partition

SYSTEMS = ("engine", "engine_unpipelined", "engine_even_split", "hf_static", "hf_cb", "vllm")
DEFAULT_SYSTEMS = ("engine", "hf_static", "hf_cb")
# Where ../shared/peers/setup-vllm-cpu.sh puts vLLM's CPU build (``PEER_VENV`` overrides it).
PEER_VENV_DEFAULT = Path.home() / ".cache" / "llm-cluster-peers" / "vllm-cpu"


# ---- the systems -----------------------------------------------------------------------------


def run_engine(
    model_dir: Path, wl: Workload, dtype: str, engine_args: dict[str, Any]
) -> tuple[SystemResult, dict[str, Any]]:
    from engine import LLM

    llm = LLM(str(model_dir), dtype=dtype, **engine_args)
    try:
        return _timed_generate(llm, wl)
    finally:
        llm.llm_engine.shutdown()  # Ray workers give their CPUs back for the next system


def _timed_generate(llm: Any, wl: Workload) -> tuple[SystemResult, dict[str, Any]]:
    from engine import SamplingParams

    params = [
        SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n)
        for n in wl.output_lens
    ]
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    engine = llm.llm_engine
    engine.step_timer.reset()
    for core in getattr(engine, "cores", [engine]):  # a data-parallel engine's, each core's
        core.spec_decode_stats.reset()
    engine.executor.collective_rpc("reset_step_timings")
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != wl.output_tokens:
        raise RuntimeError(f"engine produced {produced} tokens, expected {wl.output_tokens}")
    profile = _step_profile(engine, wall)
    if engine.config.speculative.speculative_config is not None:
        profile["spec_decode"] = engine.spec_decode_stats.as_dict()
    block_bytes = engine.executor.collective_rpc("kv_block_bytes")[0]
    kv_per_token = block_bytes // engine.config.cache.block_size
    result = SystemResult(wall, wl.output_tokens, wl.total_tokens, len(wl.prompts), kv_per_token)
    return result, profile


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def default_vllm_python() -> str:
    """The peer venv's interpreter when it exists, else this one."""
    venv = Path(os.environ.get("PEER_VENV") or PEER_VENV_DEFAULT)
    python = venv / "bin" / "python"
    return str(python) if python.exists() else sys.executable


def check_vllm_python(python: str) -> str:
    """vLLM's version under ``python``; a clear error when it has none."""
    probe = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(
            f"--vllm-python: {python} cannot import vllm ({last}); set up vLLM's CPU build with "
            "../shared/peers/setup-vllm-cpu.sh and pass its venv's python"
        )
    return probe.stdout.strip()


def run_vllm(
    model_dir: Path, wl: Workload, dtype: str, engine_args: dict[str, Any], python: str
) -> SystemResult:
    """vLLM on the same workload, in its own process (``vllm_offline.py`` under ``python``)."""
    spec = {
        "model": str(model_dir),
        "dtype": dtype,
        "prompts": wl.prompts,
        "output_lens": wl.output_lens,
        **engine_args,
    }
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, the peers' recipe
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        script = Path(__file__).with_name("vllm_offline.py")
        done = subprocess.run(
            [python, str(script), str(spec_path), str(result_path)],
            capture_output=True, text=True, env=env, timeout=7200,
        )  # fmt: skip
        if done.returncode != 0:
            # vLLM logs its workers' root cause far above its own traceback's end: name it first.
            errors = dict.fromkeys(
                line.split("] ", 1)[-1] for line in done.stderr.splitlines() if "Error: " in line
            )
            raise RuntimeError(
                f"vllm failed (exit {done.returncode}): {' | '.join(errors) or 'see below'}\n"
                f"{done.stderr[-3000:]}"
            )
        result = json.loads(result_path.read_text())
    if result["output_tokens"] != wl.output_tokens:
        raise RuntimeError(
            f"vllm produced {result['output_tokens']} tokens, expected {wl.output_tokens}"
        )
    # vLLM's CPU cache is VLLM_CPU_KVCACHE_SPACE GiB cut into whole blocks of its tokens.
    kv_space = float(env["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    kv_per_token = int(kv_space // result["kv_cache_tokens"])
    return SystemResult(
        result["wall_s"], wl.output_tokens, wl.total_tokens, len(wl.prompts), kv_per_token
    )


def _step_profile(engine: Any, wall: float) -> dict[str, Any]:
    head = dict(engine.step_timer.totals)
    timings = engine.executor.collective_rpc("step_timings")
    worker = timings[0]
    phases = {
        "scheduler": head.get("schedule", 0.0),
        "input_preparation": worker.get("prepare_inputs", 0.0),
        "forward": worker.get("forward", 0.0),
        "lm_head": worker.get("lm_head", 0.0),
        "sampling": worker.get("sample", 0.0),
        "update": head.get("update", 0.0),
        "detokenization": head.get("detokenize", 0.0),
    }
    accounted = sum(phases.values())
    phases["other"] = max(0.0, wall - accounted)
    return {
        "seconds": phases,
        "fraction": {k: v / wall for k, v in phases.items()},
        "scheduler_plus_input_preparation": (phases["scheduler"] + phases["input_preparation"])
        / wall,
        # Per worker rank (stage by stage): seconds in its model-runner phases, less the
        # transfers between stages (which wait on the neighbour); with PP the stages' balance.
        "worker_busy_s": [
            sum(t.values()) - t.get("receive", 0.0) - t.get("send", 0.0) for t in timings
        ],
    }


# ---- driver ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults: a decode-heavy workload sized for a 2-core CPU (about 4 minutes for all systems).
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=token_range, default=(16, 64), metavar="LO:HI")
    parser.add_argument("--output-len", type=token_range, default=(64, 192), metavar="LO:HI")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"subset of {','.join(SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)})",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="interpreter with vLLM for --systems vllm (default: $PEER_VENV/bin/python, "
        f"else {PEER_VENV_DEFAULT}/bin/python, else this one)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the systems N times in turn; report medians"
    )
    parser.add_argument(
        "--hf-batch-size", type=int, default=64, help="static batch size of hf_static"
    )
    parser.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")
    parser.add_argument(
        "--model", default=None, help="HF directory (default: a built-in random --family model)"
    )
    add_shape_arguments(parser)
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="engine and vLLM: no CUDA graphs; vLLM also skips torch.compile (starts in about "
        "half the time on CPU, runs its steps slower)",
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="engine: TP (Ray workers when > 1)"
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="engine: PP (Ray workers when > 1); engine_unpipelined runs it one batch at a time",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine: data-parallel attention cores of a MoE model (needs "
        "--enable-expert-parallel: the experts split over all DP x TP ranks)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="engine: whole experts per rank instead of a slice of every expert",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='engine: speculative decoding, vLLM\'s JSON (\'{"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_max": 3}\')',
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the systems asked for, in turn, and return the report. The systems:

    - ``engine``: this project's ``LLM.generate`` (continuous batching, paged KV cache);
    - ``engine_unpipelined`` and ``engine_even_split`` (with ``--pipeline-parallel-size`` > 1):
      the same engine running one batch at a time (``LLM_CLUSTER_PP_PIPELINING=0``), or
      pipelined with the layers split evenly over the stages (``VLLM_PP_LAYER_PARTITION``)
      instead of the balanced default (``engine.pp_partition``), to compare with;
    - ``hf_static``: ``model.generate`` in static, left-padded batches (vLLM's ``--backend hf``):
      each batch runs until its longest output, so shorter requests waste their slots;
    - ``hf_cb``: transformers' continuous-batching manager (``init_continuous_batching``), with
      each request's own ``max_new_tokens``;
    - ``vllm`` (only when asked for): vLLM's ``LLM.generate`` on the same model directory and
      workload, in its own process under ``--vllm-python`` (vLLM lives in a venv of its own, see
      ``../shared/peers/``), with the same engine limits.
    """
    from engine.builtin.tiny_models import materialize

    if args.model and args.family:
        raise SystemExit("--family picks the built-in random model; it cannot go with --model")
    shape = shape_from_args(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    model_dir = (
        Path(args.model) if args.model else materialize(shape.dirname, bench_model_builder(shape))
    )
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    vllm_python = args.vllm_python or default_vllm_python()
    vllm_version = check_vllm_python(vllm_python) if "vllm" in systems else None
    wl = make_workload(
        args.num_prompts, args.input_len, args.output_len, shape.vocab_size, args.seed
    )
    max_len = max(len(p) for p in wl.prompts) + max(wl.output_lens)
    engine_args = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": max_len,
        "seed": args.seed,
        "enforce_eager": args.enforce_eager,
    }
    if args.speculative_config is not None:
        engine_args["speculative_config"] = args.speculative_config
    if args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size > 1:
        engine_args["tensor_parallel_size"] = args.tensor_parallel_size
        engine_args["pipeline_parallel_size"] = args.pipeline_parallel_size
        engine_args["data_parallel_size"] = args.data_parallel_size
    if args.enable_expert_parallel:
        engine_args["enable_expert_parallel"] = True
    partitions = stage_partitions(model_dir, args.pipeline_parallel_size)
    if "engine_even_split" in systems and args.pipeline_parallel_size == 1:
        raise SystemExit("--systems engine_even_split needs --pipeline-parallel-size > 1")
    torch_dtype = getattr(torch, dtype)
    gemm = measure_gemm_flops(torch_dtype, device)
    rounds: dict[str, list[SystemResult]] = {s: [] for s in systems}
    profiles: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for system in systems:
            label = f" (round {round_index + 1}/{args.rounds})" if args.rounds > 1 else ""
            print(f"running {system}{label} ...", flush=True)
            if system == "engine":
                result, profile = run_engine(model_dir, wl, dtype, engine_args)
                profiles.append(profile)
            elif system == "engine_unpipelined":  # PP one batch at a time, for comparison
                with _env("LLM_CLUSTER_PP_PIPELINING", "0"):
                    result, _ = run_engine(model_dir, wl, dtype, engine_args)
            elif system == "engine_even_split":
                even = ",".join(map(str, partitions["engine_even_split"]))
                with _env(envs.PP_LAYER_PARTITION, even):
                    result, _ = run_engine(model_dir, wl, dtype, engine_args)
            elif system == "vllm":
                result = run_vllm(model_dir, wl, dtype, engine_args, vllm_python)
            else:
                hf = load_hf(model_dir, dtype)
                result = (
                    run_hf_static(hf, wl, args.hf_batch_size)
                    if system == "hf_static"
                    else run_hf_cb(hf, wl)
                )
                del hf
            rounds[system].append(result)
    results = {s: _median(r) for s, r in rounds.items()}
    # The profile of the engine's median round.
    profile = profiles[rounds["engine"].index(results["engine"])] if profiles else {}
    report = _report(shape, wl, args, device, dtype, gemm, results, profile)
    if args.pipeline_parallel_size > 1:
        report["conditions"]["layer_partition"] = {
            s: list(partitions[s]) for s in systems if s in partitions
        }
    report["rounds"] = {s: [r.output_tokens / r.wall_s for r in rs] for s, rs in rounds.items()}
    if vllm_version is not None:
        report["conditions"]["vllm"] = {"version": vllm_version, "python": vllm_python}
    _print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return report


def stage_partitions(model_dir: Path, pp_size: int) -> dict[str, tuple[int, ...]]:
    """Decoder layers per stage of the engine systems: the engine's own choice (the balanced
    default, or ``VLLM_PP_LAYER_PARTITION`` when set) and the even split."""
    hf = json.loads((model_dir / "config.json").read_text())
    num_layers = int(hf["num_hidden_layers"])
    chosen = layer_partition(hf, pp_size, requested_partition(None, pp_size, num_layers))
    return {
        "engine": chosen,
        "engine_unpipelined": chosen,
        "engine_even_split": balanced_partition(num_layers, pp_size, 0.0),
    }


def cpu_description() -> str:
    """The CPU's model name and the vector ISA extensions that decide GEMM speed (Linux)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "cpu"
    fields: dict[str, str] = {}
    for line in info.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            break  # the first processor's block ends at its blank line
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or "cpu"
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX2'})"


def _median(results: list[SystemResult]) -> SystemResult:
    """The round with the median wall time (the lower middle one for an even count)."""
    ordered = sorted(results, key=lambda r: r.wall_s)
    return ordered[(len(ordered) - 1) // 2]


def _report(
    shape: ModelShape,
    wl: Workload,
    args: argparse.Namespace,
    device: str,
    dtype: str,
    gemm: float,
    results: dict[str, SystemResult],
    profile: dict[str, Any],
) -> dict[str, Any]:
    systems = {name: r.as_dict() for name, r in results.items()}
    ratios: dict[str, float] = {}
    if "engine" in systems:
        for name in systems:
            if name != "engine":
                ratios[f"engine/{name}"] = (
                    systems["engine"]["output_tokens_per_s"] / systems[name]["output_tokens_per_s"]
                )
    roofline: dict[str, Any] = {"gemm_flops_per_s": gemm}
    if "engine" in results:
        achieved = engine_flops(shape, wl) / results["engine"].wall_s
        roofline.update(engine_flops_per_s=achieved, engine_fraction_of_gemm=achieved / gemm)
    conditions = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        + (torch.cuda.get_device_name() if device == "cuda" else cpu_description()),
        "device": device,
        "dtype": dtype,
        "torch": torch.__version__,
        "model": {**asdict(shape), "parameters": shape.total_params()},
        "workload": {
            "num_prompts": len(wl.prompts),
            "input_len": list(args.input_len),
            "output_len": list(args.output_len),
            "seed": args.seed,
            "ignore_eos": True,
            "output_tokens": wl.output_tokens,
            "total_tokens": wl.total_tokens,
        },
        "engine": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enforce_eager": args.enforce_eager,
            "tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size,
            "data_parallel_size": args.data_parallel_size,
            "enable_expert_parallel": args.enable_expert_parallel,
            "speculative_config": args.speculative_config,
        },
        "hf_static_batch_size": args.hf_batch_size,
    }
    return {
        "systems": systems,
        "ratios": ratios,
        "roofline": roofline,
        "step_profile": profile,
        "conditions": conditions,
    }


def _print_table(report: dict[str, Any]) -> None:
    c = report["conditions"]
    print(
        f"\n{c['date']}  {c['machine']}  {c['device']} {c['dtype']}  "
        f"model {c['model']['family']} {c['model']['parameters'] / 1e6:.0f}M params  "
        f"{c['workload']['num_prompts']} prompts, in {c['workload']['input_len']}, "
        f"out {c['workload']['output_len']}"
    )
    print(
        f"{'system':<20}{'out tok/s':>12}{'total tok/s':>13}{'req/s':>9}{'wall s':>9}"
        f"{'KV B/token':>12}"
    )
    for name, r in report["systems"].items():
        kv = r.get("kv_cache_bytes_per_token")
        print(
            f"{name:<20}{r['output_tokens_per_s']:>12.1f}{r['total_tokens_per_s']:>13.1f}"
            f"{r['requests_per_s']:>9.2f}{r['wall_s']:>9.1f}{kv if kv is not None else '-':>12}"
        )
    for name, values in report.get("rounds", {}).items():
        if len(values) > 1:
            print(f"{name} rounds (out tok/s): " + ", ".join(f"{v:.1f}" for v in values))
    for name, value in report["ratios"].items():
        print(f"ratio {name}: {value:.2f}x")
    for name, partition in c.get("layer_partition", {}).items():
        print(f"{name} layers per stage: {partition}")
    busy = report["step_profile"].get("worker_busy_s", [])
    if len(busy) > 1:
        print("engine busy s per worker rank: " + ", ".join(f"{b:.1f}" for b in busy))
    roof = report["roofline"]
    if "engine_fraction_of_gemm" in roof:
        fraction = roof["engine_fraction_of_gemm"]
        print(
            f"roofline: GEMM {roof['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s, engine "
            f"{roof['engine_flops_per_s'] / 1e9:.1f} GFLOP/s = {fraction:.0%}"
        )
    spec = report["step_profile"].get("spec_decode")
    if spec:
        print(
            f"speculative decoding: {spec['num_draft_tokens']} proposed, "
            f"{spec['num_accepted_tokens']} accepted ({spec['acceptance_rate']:.1%}), mean "
            f"acceptance length {spec['mean_acceptance_length']:.2f}, per position "
            f"{spec['accepted_per_pos']}"
        )
    if report["step_profile"]:
        fractions = report["step_profile"]["fraction"]
        print("engine step profile: " + ", ".join(f"{k} {v:.1%}" for k, v in fractions.items()))
