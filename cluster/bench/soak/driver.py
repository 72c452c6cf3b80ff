"""One soak run and its command line: ``soak`` drives the load against an endpoint, with the
probes when attached to its Ray cluster, and returns the report; ``run`` / ``main`` deploy a
config on a new local Ray (or target a running endpoint), print the report and exit 1 on a
finding."""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import json
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cluster.bench.soak.load import SoakLoad, SoakSettings, make_client
from cluster.bench.soak.outcomes import RequestRecord
from cluster.bench.soak.probes import ReadinessSampler, RssSampler, ServeProbe, health_url
from cluster.bench.soak.report import findings, summarize


async def soak(
    base_url: str,
    model: str,
    settings: SoakSettings,
    *,
    api_key: str | None = None,
    probe: ServeProbe | None = None,
    idle_timeout_s: float = 60.0,
    progress: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """Run the load for ``settings.duration_s`` and return the report (``findings(report)``
    lists what failed). ``GET /health`` is asked every second throughout and must answer 200.
    With a ``probe``, resident memory is sampled during the run, and after each half the load
    rests: the half's requests run to their ends, every replica must go idle, and then each
    process's memory is read (the halves' growth compares those readings). The report's
    ``duration_s`` and throughput leave the rests out."""
    settings.check()
    records: dict[int, RequestRecord] = {}
    client = make_client(base_url, api_key, records, settings)
    load = SoakLoad(client, model, settings, records)
    sampler = None
    if probe is not None:
        sampler = RssSampler(await asyncio.to_thread(probe.processes), settings.rss_interval_s)
    readiness = ReadinessSampler(health_url(base_url))
    stop = asyncio.Event()
    load.start = time.monotonic()
    sampling = asyncio.create_task(sampler.run(load.start, stop)) if sampler else None
    probing = asyncio.create_task(readiness.run(load.start, stop))
    ticker = asyncio.create_task(_report_progress(load, settings, progress))
    rests: list[dict[str, Any]] = []
    rest = None
    if probe is not None and sampler is not None:
        rest = _rest(probe, sampler, load, rests, idle_timeout_s, progress)
    try:
        await load.run(rest)
    finally:
        stop.set()
        ticker.cancel()
        if sampling is not None:
            await sampling
        await probing
        await client.close()
    load_s = time.monotonic() - load.start - sum(rest["took_s"] for rest in rests)
    report = summarize(list(records.values()), load, settings, load_s)
    report["readiness"] = readiness.summary()
    if sampler is not None:
        report["rss"] = sampler.summary()
        report["idle_between_halves"], report["idle"] = rests
    return report


def _rest(
    probe: ServeProbe,
    sampler: RssSampler,
    load: SoakLoad,
    rests: list[dict[str, Any]],
    idle_timeout_s: float,
    progress: Callable[[str], None],
) -> Callable[[str], Awaitable[None]]:
    """What the load awaits after each half, with nothing in flight: every replica idle (its
    state appended to ``rests``), then each process's memory read at rest."""

    async def rest(label: str) -> None:
        at_s = time.monotonic() - load.start
        progress(f"{at_s:6.0f} s  {label} done: waiting for idle, then memory at rest")
        began = time.monotonic()
        entry: dict[str, Any] = {"after": label, "at_s": round(at_s, 1)}
        try:
            idle, states, waited = await asyncio.to_thread(probe.wait_idle, idle_timeout_s)
        except Exception as exc:  # no replica to answer: the finding is that it is gone
            entry.update(reached=False, error=f"{type(exc).__name__}: {exc}")
        else:
            entry.update(reached=idle, waited_s=round(waited, 1), replicas=states)
        rests.append(entry)
        await sampler.read_at_rest(label)
        entry["took_s"] = round(time.monotonic() - began, 1)

    return rest


async def _report_progress(
    load: SoakLoad, settings: SoakSettings, progress: Callable[[str], None]
) -> None:
    while True:
        await asyncio.sleep(max(5.0, settings.duration_s / 20))
        outcomes = Counter(r.outcome for r in load.records.values() if r.end)
        elapsed = time.monotonic() - load.start
        progress(
            f"{elapsed:6.0f} s  in flight {load.in_flight:4d}  {dict(sorted(outcomes.items()))}"
        )


def _range(text: str) -> tuple[int, int]:
    from cluster.bench.workload import token_range as parse

    return parse(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--config", type=Path, default=None, help="deploy this YAML on a new local Ray and soak it"
    )
    target.add_argument(
        "--base-url", default=None, help="soak a running endpoint, e.g. http://127.0.0.1:8000/v1"
    )
    parser.add_argument(
        "--address",
        default=None,
        help="with --base-url: its Ray cluster, for the memory and idle checks",
    )
    parser.add_argument("--app", default=None, help="Serve application (default: the config's)")
    parser.add_argument("--model", default=None, help="model name (default: the first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--free-ports",
        action="store_true",
        help="with --config: spare HTTP and gRPC ports (20000-29999), not the config's",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="with --config: override the model's Serve max_queued_requests",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="with --config: override the engine's max_waiting_requests",
    )
    defaults = SoakSettings()
    parser.add_argument("--duration", type=float, default=defaults.duration_s)
    parser.add_argument("--warmup", type=float, default=defaults.warmup_s)
    parser.add_argument("--clients", type=int, default=defaults.clients)
    parser.add_argument("--cancel-fraction", type=float, default=defaults.cancel_fraction)
    parser.add_argument(
        "--burst-size",
        type=int,
        default=None,
        help="default: 10x the model's max_ongoing_requests (with --config), "
        f"else {defaults.burst_size}",
    )
    parser.add_argument("--burst-interval", type=float, default=defaults.burst_interval_s)
    parser.add_argument("--prompt-len", type=_range, default=defaults.prompt_len, metavar="LO:HI")
    parser.add_argument("--max-tokens", type=_range, default=defaults.max_tokens, metavar="LO:HI")
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s)
    parser.add_argument("--rss-interval", type=float, default=defaults.rss_interval_s)
    parser.add_argument("--max-rss-growth-pct", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak the arguments describe, print the report as JSON; ``SystemExit(1)`` on a
    finding."""
    report = asyncio.run(_run(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    if report["findings"]:
        print("FINDINGS:\n  " + "\n  ".join(report["findings"]), file=sys.stderr)
        raise SystemExit(1)
    return report


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.base_url:
        return await _run_remote(args, progress)
    from cluster.config import load_config
    from cluster.ops.deploy import connect, deploy, endpoint
    from cluster.ops.ports import PortInUseError, check_ports_free, config_ports

    config = load_config(_config_dict(args))
    model = config.model(args.model) if args.model else config.models[0]
    settings = _settings(args, 10 * model.deployment_config.max_ongoing_requests)
    try:  # before Ray starts, as cluster serve does: Serve would fail later, with a traceback
        check_ports_free(config_ports(config))
    except PortInUseError as exc:
        raise SystemExit(f"error: {exc} (or pass --free-ports)") from None
    connect("local")  # its own Ray: never a stale or foreign cluster found on this machine
    import ray

    try:
        await asyncio.to_thread(deploy, config, progress)
        probe = ServeProbe(config.app_name, model.model_id)
        report = await soak(
            endpoint(config),
            model.model_id,
            settings,
            api_key=args.api_key,
            probe=probe,
            progress=progress,
        )
    finally:
        # Its own Ray, stopped whole: a drain is of no use here, and Serve stopped first
        # would fail the driver's handle polls (Ray prints each failure to stdout, before
        # the JSON report).
        ray.shutdown()
    return _with_conditions(report, args, settings, str(args.config))


async def _run_remote(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "not-needed")
    model = args.model or (await client.models.list()).data[0].id
    await client.close()
    probe = None
    if args.address:
        from cluster.ops.deploy import connect

        connect(args.address)
        probe = ServeProbe(args.app or "llm", model)
    settings = _settings(args, SoakSettings().burst_size)
    report = await soak(
        args.base_url, model, settings, api_key=args.api_key, probe=probe, progress=progress
    )
    return _with_conditions(report, args, settings, args.base_url)


def _config_dict(args: argparse.Namespace) -> dict[str, Any]:
    """The YAML with this run's overrides: ports, the model's admission-control limits."""
    import yaml

    data = copy.deepcopy(yaml.safe_load(args.config.read_text()))
    if args.free_ports:
        from cluster.ops.deploy import spare_port

        data.setdefault("http_options", {})["port"] = spare_port()
        if data.get("grpc_options") is not None:
            data["grpc_options"]["port"] = spare_port()
    models = data.get("models") or []
    ids = [m.get("model_loading_config", {}).get("model_id") for m in models]
    if args.model is not None and args.model not in ids:
        raise SystemExit(f"--model: {args.model!r} is not in {args.config} (models: {ids})")
    for model in models:
        if args.model not in (None, model["model_loading_config"]["model_id"]):
            continue
        if args.max_queued_requests is not None:
            model.setdefault("deployment_config", {})["max_queued_requests"] = (
                args.max_queued_requests
            )
        if args.max_waiting_requests is not None:
            model.setdefault("engine_kwargs", {})["max_waiting_requests"] = (
                args.max_waiting_requests
            )
        if args.model is None:
            break  # the soak drives the first model
    return data


def _settings(args: argparse.Namespace, default_burst: int) -> SoakSettings:
    settings = SoakSettings(
        duration_s=args.duration,
        warmup_s=args.warmup,
        clients=args.clients,
        cancel_fraction=args.cancel_fraction,
        burst_size=args.burst_size if args.burst_size is not None else default_burst,
        burst_interval_s=args.burst_interval,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        rss_interval_s=args.rss_interval,
        seed=args.seed,
    )
    try:
        settings.check()
    except ValueError as exc:
        raise SystemExit(f"soak: {exc}") from None
    return settings


def _with_conditions(
    report: dict[str, Any], args: argparse.Namespace, settings: SoakSettings, target: str
) -> dict[str, Any]:
    conditions = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}",
        "target": target,
        "max_queued_requests": args.max_queued_requests,
        "max_waiting_requests": args.max_waiting_requests,
        **asdict(settings),
    }
    report = {"conditions": conditions, **report}
    report["findings"] = findings(report, args.max_rss_growth_pct)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.bench.soak",
        description=sys.modules["cluster.bench.soak"].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    run(require_target(parser, parser.parse_args(argv)))
    return 0


def require_target(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.config is None and args.base_url is None:
        parser.error("give --config (deploy locally) or --base-url (a running endpoint)")
    return args
