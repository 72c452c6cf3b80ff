"""The ``cluster`` command line.

cluster make-model tiny-llama DIR     write a built-in tiny model (HF format) to DIR
cluster generate --model M PROMPT...  offline generation with the engine
cluster plan CONFIG                   whether each model fits its GPUs (memory per GPU, KV cache)
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.config import DeploymentConfig
    from cluster.ops.stop import StopSignals
    from engine.startup_timeline import StartupTimeline


def _make_model(args: argparse.Namespace) -> int:
    from engine.builtin.tiny_models import make_tiny_model

    path = make_tiny_model(args.name, args.out_dir, seed=args.seed)
    print(f"wrote {args.name} to {path}")
    return 0


def _parse_engine_args(pairs: Sequence[str]) -> dict[str, object]:
    """``--engine-arg key=value``: value parsed as JSON when it is JSON, else kept as a string."""
    engine_args: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg: expected key=value, got {pair!r}")
        try:
            engine_args[key] = json.loads(value)
        except json.JSONDecodeError:
            engine_args[key] = value
    return engine_args


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, ConfigError, InvalidRequestError, SamplingParams

    try:
        llm = LLM(args.model, **_parse_engine_args(args.engine_arg))
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except (ConfigError, InvalidRequestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, output in zip(args.prompts, outputs, strict=True):
        completion = output.outputs[0]
        print(
            f"prompt: {prompt!r}\ncompletion: {completion.text!r}  "
            f"({len(completion.token_ids)} tokens, finish_reason={completion.finish_reason})"
        )
    return 0


def _load_config(path: str) -> DeploymentConfig:
    from cluster.config import load_config
    from engine.config import ConfigError

    try:
        config = load_config(path)
        if config.api_keys is not None:
            config.api_keys.load_key_hashes()
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return config


def _refuse_busy_ports_before_loading(path: str) -> None:
    """Exit 1 naming a port of the config that is in use here, before the config is loaded
    in full (its engine check reads the checkpoint, seconds); a config that does not parse is
    left to ``_load_config`` to report."""
    from cluster.config import parse_config
    from cluster.ops import ports

    try:
        config = parse_config(path)
        config.http_options.check("http_options")  # a host with a port is a config error
    except (TypeError, ValueError):  # ConfigError is a ValueError
        return
    _refuse_ports_in_use(lambda: ports.check_ports_free(ports.config_ports(config)))


def _deploy_and_report(
    config: DeploymentConfig,
    address: str | None,
    signals: StopSignals,
    direct_ingress: bool = False,
    timeline: StartupTimeline | None = None,
) -> None:
    """``direct_ingress`` (a new local cluster only): the ingress replica serves the config's
    ports itself, without Serve's proxy hop (``deploy.direct_ingress``). A signal meanwhile
    raises ``StopRequested`` (``signals``) wherever this waits. ``timeline``: marks as Ray,
    Serve and the replicas come up, printed once the API serves."""
    import logging

    from cluster.ops import deploy, ports, stop
    from cluster.ops.plan import PlanError, preflight

    try:
        # Before a local Ray starts: a model that cannot fit its GPUs starts nothing.
        preflight(config)
    except PlanError as exc:
        for model_id, reasons in exc.problems.items():
            for reason in reasons:
                print(f"refused: {model_id}: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if address == "local":  # Ray and Serve start here: the ports must be free here, now
        _refuse_ports_in_use(lambda: ports.check_ports_free(ports.config_ports(config)))
        stop.abort_streams_on_gcs_loss()
    deployed = deploy.direct_ingress(config) if direct_ingress else None
    if deployed is not None:  # Serve would announce the idle proxy's spare port as the app's
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    try:
        deploy.connect(address, num_cpus=sum(m.cpus_at_max_scale() for m in config.models))
    except SystemExit as exc:  # ray.init's own SIGTERM handler, while it ran
        if exc.code != signal.SIGTERM:
            raise
        raise stop.StopRequested(signal.SIGTERM) from None
    if timeline is not None:
        timeline.mark("ray start")
    signals.install()  # over ray.init's handlers (a C++ one dumps a stack and aborts)
    if address != "local":
        _refuse_ports_in_use(lambda: ports.check_cluster_ports(config))
    names = ", ".join(m.model_id for m in config.models)
    print(f"deploying {names} (app {config.app_name!r}); loading models...", flush=True)
    try:
        deploy.deploy(
            deployed or config, progress=_with_time_to_ready(time.monotonic()), timeline=timeline
        )
    except deploy.DeployError as exc:
        for reason in exc.reasons.values():
            print(f"error: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    if deployed is not None:
        deploy.wait_for_port(config.http_options.host, config.http_options.port)
    if timeline is not None:
        timeline.mark("ingress port")
        print(timeline.line(), flush=True)
    print(f"ready: OpenAI API at {deploy.endpoint(config)}", flush=True)
    if config.grpc_options is not None:
        # Ray Serve binds gRPC to every interface whatever http_options.host says.
        print(f"gRPC (llmcluster.LLM) on port {config.grpc_options.port}, every interface"
              f"{'' if config.api_keys is not None else ', no API key'}", flush=True)  # fmt: skip


def _refuse_ports_in_use(check: Callable[[], None]) -> None:
    from cluster.ops.ports import PortInUseError

    try:
        check()
    except PortInUseError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _with_time_to_ready(started: float) -> Callable[[str], None]:
    """Print ``deploy``'s status lines; a model deployment's first HEALTHY line gets the time
    since the deploy began (``  LLMServer:m: HEALTHY (1 running), ready in 214 s``)."""
    ready: set[str] = set()

    def report(line: str) -> None:
        deployment, _, state = line.strip().partition(": ")
        model = deployment.startswith("LLMServer:")
        if model and state.startswith("HEALTHY") and deployment not in ready:
            ready.add(deployment)
            line += f", ready in {time.monotonic() - started:.0f} s"
        print(line, flush=True)

    return report


def _print_loading(workers: list[dict[str, Any]]) -> None:
    """``cluster status`` lines for a model's starting workers
    (``cluster.runtime.load_progress``)."""
    for w in workers:
        where = f"    starting: rank {w['rank']} on {w['node']}: {w['phase']}"
        if w.get("percent") is not None and w["phase"] == "loading weights":
            scale, unit = (1 << 30, "GiB") if w["bytes_total"] >= 1 << 30 else (1 << 20, "MiB")
            read, total = w["bytes_read"] / scale, w["bytes_total"] / scale
            where += f" {read:.2f}/{total:.2f} {unit} ({w['percent']:.0f}%)"
        print(f"{where}, {w['seconds']:.0f} s since start ({w['phase_seconds']:.0f} s in phase)")


def _serve(args: argparse.Namespace) -> int:
    """Start (a local Ray unless ``--address``), deploy, serve until SIGINT, SIGTERM or SIGHUP,
    drain, stop Ray, and return once the config's ports are free (``cluster.ops.stop``)."""
    import ray

    from cluster.ops import deploy, ports
    from cluster.ops import stop as stopping
    from engine.startup_timeline import StartupTimeline

    signals = stopping.StopSignals()  # first of all: a stop during start-up is handled
    timeline = StartupTimeline("cluster serve", from_process_start=True)
    timeline.mark("imports")
    local = args.address == "local"
    config = None
    try:
        if local:
            _refuse_busy_ports_before_loading(args.config)
        config = _load_config(args.config)
        timeline.mark("config")
        _deploy_and_report(
            config, args.address, signals, direct_ingress=local and not args.proxy,
            timeline=timeline,
        )  # fmt: skip
        signals.serving()
    except stopping.StopRequested as stop:
        return _stopped_while_starting(config, local, stop.signum)
    print("serving; press Ctrl-C (or send SIGTERM) to stop", flush=True)
    gcs_address = ray.get_runtime_context().gcs_address
    while not signals.requested.wait(1.0):
        pass
    print("shutting down: draining in-flight requests", flush=True)
    # On a cluster of its own everything goes; on another's (--address) only its application.
    own_app = None if local or config is None else config.app_name
    if not stopping.drain_unless_gcs_gone(lambda: deploy.shutdown(own_app), gcs_address):
        # The signal reached Ray's processes too (a whole cgroup): Ray stopped with us.
        print("Ray's processes were stopped by the same signal: nothing left to drain", flush=True)
        stopping.exit_without_ray(0)
    if local:
        _report_held_ports(stopping.stop_local_ray(ports.config_ports(config)))
    return 0


def _stopped_while_starting(config: DeploymentConfig | None, local: bool, signum: int) -> int:
    """A stop signal while ``cluster serve`` started (``config`` None: before it was read):
    remove what was deployed, stop the local Ray, and say so in one line; 130 for Ctrl-C, 0
    for SIGTERM, 129 for SIGHUP."""
    import ray

    from cluster.ops import deploy, ports
    from cluster.ops import stop as stopping

    name = signal.Signals(signum).name
    code = stopping.StopSignals.exit_code(signum)
    stopped = []

    def remove_deployed() -> None:
        if config is not None and config.app_name in deploy.deployed_apps():
            models = ", ".join(m.model_id for m in config.models)
            stopped.append(f"removed application {config.app_name!r} ({models})")
        if local:
            deploy.shutdown()
        elif config is not None:  # another's cluster: only what this command deployed
            deploy.shutdown(config.app_name)

    if ray.is_initialized():
        gcs_address = ray.get_runtime_context().gcs_address
        if not stopping.drain_unless_gcs_gone(remove_deployed, gcs_address):
            print(f"stopped by {name} while starting: Ray's processes were stopped by the same "
                  "signal", flush=True)  # fmt: skip
            stopping.exit_without_ray(code)
    held: list[int] = []
    if local and (ray.is_initialized() or stopping.local_ray_started()):
        held = stopping.stop_local_ray(ports.config_ports(config) if config else [])
        stopped.append("stopped the local Ray")
    print(f"stopped by {name} while starting: {'; '.join(stopped) or 'nothing had started'}",
          flush=True)  # fmt: skip
    _report_held_ports(held)
    return code


def _report_held_ports(held: list[int]) -> None:
    if held:
        print(f"warning: port {', '.join(map(str, held))} still in use after Ray stopped",
              file=sys.stderr, flush=True)  # fmt: skip


def _hf_config_args(values: Sequence[str], config: DeploymentConfig) -> dict[str, dict]:
    """``--hf-config [MODEL_ID=]PATH``: the config.json (or a directory holding it) to plan
    MODEL_ID with; without ``MODEL_ID=`` when the deployment has one model."""
    from pathlib import Path

    from cluster.ops.plan import read_config_json
    from engine.errors import ConfigError

    found: dict[str, dict] = {}
    for value in values:
        model_id, sep, path = value.rpartition("=")
        if not sep:
            if len(config.models) != 1:
                raise ConfigError(f"--hf-config: {value!r}: name the model (MODEL_ID=PATH), "
                                  f"the config has {len(config.models)}")  # fmt: skip
            model_id = config.models[0].model_id
        where = Path(path).expanduser()
        found[model_id] = read_config_json(
            where / "config.json" if where.is_dir() else where, "--hf-config"
        )
    return found


def _plan(args: argparse.Namespace) -> int:
    """Print every model's memory plan; exit 2 (reasons on stderr) when one cannot fit or the
    config is refused, 0 when all fit."""
    from cluster.config import load_config
    from cluster.ops import plan as planning
    from engine.errors import ConfigError

    config_error = None
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        # The engine refuses something in the config (an unsupported quant_method, ...): still
        # show what the models would need, when the YAML's structure allows it.
        config_error = exc
        config = planning.load_unchecked(args.config)
    refused = config_error is not None
    if config is not None:
        try:
            hf_configs = _hf_config_args(args.hf_config, config)
            plan = planning.plan_deployment(config, args.gpu_memory_gib, hf_configs)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(plan.to_json() if args.json else plan.format_text(), flush=True)
        for model_id, reasons in plan.problems().items():
            for reason in reasons:
                print(f"refused: {model_id}: {reason}", file=sys.stderr)
        refused = refused or not plan.fits
    if config_error is not None:
        print(f"config error: {config_error}", file=sys.stderr)
    return 2 if refused else 0


def _deploy(args: argparse.Namespace) -> int:
    """Deploy and wait until every model serves. Ctrl-C (or SIGTERM) stops the waiting only:
    the application keeps deploying on the cluster."""
    from cluster.ops.stop import StopRequested, StopSignals

    signals = StopSignals()
    try:
        config = _load_config(args.config)
    except StopRequested as stop:  # nothing was deployed yet
        print("stopped while reading the config; nothing was deployed", flush=True)
        return StopSignals.exit_code(stop.signum)
    try:
        _deploy_and_report(config, args.address, signals)
    except StopRequested as stop:
        print(
            f"stopped waiting: application {config.app_name!r} keeps deploying on the "
            "cluster ('cluster status' follows it, 'cluster shutdown' removes it)",
            flush=True,
        )
        return StopSignals.exit_code(stop.signum)
    return 0


def _status(args: argparse.Namespace) -> int:
    from cluster.ops import deploy

    deploy.connect(args.address)
    status = deploy.cluster_status(args.app)
    if args.json:
        print(json.dumps(status, indent=2))
        return 1 if status["status"] == "NOT_DEPLOYED" or status.get("removed") else 0
    removed = " (removed: its replicas could not start)" if status.get("removed") else ""
    print(f"app {status['app']}: {status['status']}{removed}")
    for model, entry in status["models"].items():
        replicas = ", ".join(f"{n} {s.lower()}" for s, n in entry["replicas"].items() if n)
        print(f"  {model}: {entry['status']} ({replicas or 'no replicas'})")
        if "error" in entry:
            print(f"    {entry['error']}")
        _print_loading(entry.get("loading", []))
        stats = entry.get("stats")
        if stats:
            print(
                f"    KV cache {100 * stats['kv_usage']:.1f}% used "
                f"({stats['kv_total_blocks'] - stats['kv_free_blocks']}/{stats['kv_total_blocks']}"
                f" blocks), running {stats['num_running']}, waiting {stats['num_waiting']}, "
                f"prefix-cache hit rate {100 * stats['prefix_cache_hit_rate']:.1f}%"
            )
        elif "stats_error" in entry and "error" not in entry:
            print(f"    stats unavailable: {entry['stats_error']}")
    return 1 if status["status"] == "NOT_DEPLOYED" or status.get("removed") else 0


def _sleep_or_wake(args: argparse.Namespace) -> int:
    import ray

    from cluster.api.api_errors import APIError
    from cluster.ops import deploy

    deploy.connect(args.address)
    method, extra = ("sleep_model", [args.level]) if args.command == "sleep" else (
        "wake_model", [args.tags])  # fmt: skip
    try:
        state = deploy.sleep_control(args.app, method, args.model, *extra)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if not isinstance(cause, APIError):
            raise
        print(f"error: {cause.message}", file=sys.stderr)
        return 2
    level = state["sleep_level"]
    print(f"{state['model']}: " + (f"asleep (level {level})" if level else "awake")
          + f", {state['replicas']} replica(s)")  # fmt: skip
    return 0


def _shutdown(args: argparse.Namespace) -> int:
    from cluster.ops import deploy

    deploy.connect(args.address)
    deploy.shutdown()
    print("Serve shut down: all deployments removed")
    return 0


def _add_serving_commands(sub: argparse._SubParsersAction) -> None:
    address_help = "Ray cluster address (default: $RAY_ADDRESS, else the cluster on this machine)"
    serve_cmd = sub.add_parser("serve", help="start a local Ray, deploy CONFIG, block")
    serve_cmd.add_argument("config", help="deployment YAML, e.g. configs/tiny.yaml")
    serve_cmd.add_argument(
        "--address", default="local", help="join this cluster instead of starting a local one"
    )
    serve_cmd.add_argument(
        "--proxy",
        action="store_true",
        help="route requests through Ray Serve's proxy (the default with --address) instead of "
        "serving the config's ports from the ingress replica itself (direct ingress, faster)",
    )
    serve_cmd.set_defaults(func=_serve)

    plan_cmd = sub.add_parser(
        "plan",
        help="whether each model of CONFIG fits its GPUs, before anything is placed "
        "(exit 0: fits, 2: refused)",
    )
    plan_cmd.add_argument("config", help="deployment YAML, e.g. configs/llama70b.yaml")
    plan_cmd.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        metavar="N",
        help="one GPU's memory in GiB (default: from each model's accelerator_type)",
    )
    plan_cmd.add_argument(
        "--hf-config",
        action="append",
        default=[],
        metavar="[MODEL_ID=]PATH",
        help="plan MODEL_ID from this config.json (or a directory holding it), for a "
        "checkpoint that is not on this machine (repeatable)",
    )
    plan_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    plan_cmd.set_defaults(func=_plan)

    deploy_cmd = sub.add_parser("deploy", help="deploy CONFIG to a running Ray cluster")
    deploy_cmd.add_argument("config")
    deploy_cmd.add_argument("--address", default="auto", help=address_help)
    deploy_cmd.set_defaults(func=_deploy)

    status_cmd = sub.add_parser("status", help="per model: replicas, health, KV usage, queue")
    status_cmd.add_argument("--address", default="auto", help=address_help)
    status_cmd.add_argument("--app", default="llm", help="Serve application name")
    status_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    status_cmd.set_defaults(func=_status)

    sleep_cmd = sub.add_parser(
        "sleep", help="put MODEL's replicas to sleep (level 1: KV cache freed; 2: weights too)"
    )
    sleep_cmd.add_argument("model")
    sleep_cmd.add_argument("--level", type=int, default=1, choices=(1, 2))
    wake_cmd = sub.add_parser("wake", help="wake MODEL's replicas (a request wakes them too)")
    wake_cmd.add_argument("model")
    wake_cmd.add_argument(
        "--tags", nargs="+", choices=("weights", "kv_cache"), help="wake only these (weights first)"
    )
    for cmd in (sleep_cmd, wake_cmd):
        cmd.add_argument("--address", default="auto", help=address_help)
        cmd.add_argument("--app", default="llm", help="Serve application name")
        cmd.set_defaults(func=_sleep_or_wake)

    shutdown_cmd = sub.add_parser("shutdown", help="remove every deployment and stop Serve")
    shutdown_cmd.add_argument("--address", default="auto", help=address_help)
    shutdown_cmd.set_defaults(func=_shutdown)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. Given the command line ``argv``, the benchmarks' own options (their
    modules import torch: over a second) are added only when it is a ``bench`` command, so
    ``status``, ``shutdown``, ``sleep`` and ``wake`` never import torch (``serve``, ``deploy``
    and ``plan`` import it to check the config's engine arguments)."""
    parser = argparse.ArgumentParser(prog="cluster", description="llm-cluster: LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser(
        "make-model", help="write a built-in tiny random-weight model in HF format"
    )
    make.add_argument(
        "name",
        help="tiny-llama | tiny-mistral | tiny-qwen2 | tiny-qwen3 | tiny-gemma2 | tiny-gemma3 "
        "| tiny-phi3",
    )
    make.add_argument("out_dir")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_make_model)

    gen = sub.add_parser("generate", help="offline generation on this machine")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", default="builtin:tiny-llama", help="HF directory or builtin:<name>")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine argument with vLLM's name, e.g. max_model_len=1024 (repeatable)",
    )
    gen.set_defaults(func=_generate)
    _add_serving_commands(sub)

    bench = sub.add_parser("bench", help="benchmarks (measurements, printed and written as JSON)")
    if argv is None or list(argv[:1]) == ["bench"]:
        _add_bench_commands(bench)
    return parser


def _add_bench_commands(bench: argparse.ArgumentParser) -> None:
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from cluster.bench import throughput

    tp = bench_sub.add_parser("throughput", help="offline throughput: engine vs HF transformers")
    throughput.add_arguments(tp)
    tp.set_defaults(func=lambda a: (throughput.run(a), 0)[1])
    from cluster.bench import serve as serve_bench

    sv = bench_sub.add_parser(
        "serve", help="online latency/throughput against an OpenAI endpoint (or --compare)"
    )
    serve_bench.add_arguments(sv)
    sv.set_defaults(func=lambda a: (serve_bench.run(a), 0)[1])
    from cluster.bench import prefix

    px = bench_sub.add_parser(
        "prefix", help="shared-prefix workload: 1 replica vs 2 prefix-aware vs 2 pow2"
    )
    prefix.add_arguments(px)
    px.set_defaults(func=lambda a: (prefix.run(a), 0)[1])
    from cluster.bench import disaggregation

    pd = bench_sub.add_parser(
        "pd", help="decode ITL while long prompts arrive: colocated vs prefill/decode pools"
    )
    disaggregation.add_arguments(pd)
    pd.set_defaults(func=lambda a: (disaggregation.run(a), 0)[1])
    from cluster.bench import soak

    sk = bench_sub.add_parser(
        "soak", help="bounded soak: streaming clients, cancellations, bursts; leaks and memory"
    )
    soak.add_arguments(sk)
    sk.set_defaults(func=lambda a: (soak.run(soak.require_target(sk, a)), 0)[1])


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
