"""``cluster bench prefix``: a shared-prefix workload against a model's replicas — a few long
system prompts, many users each adding a short question, Poisson arrivals — run against one
deployment per setting (1 replica; 2 replicas with the prefix-aware router; 2 with Serve's
power-of-two router; 1 and 2 replicas with the node's KV store, ``kv_transfer_config``
``SharedStorageConnector``, each setting on an empty store of its own) on a new local Ray.
Reports, per setting:

- the cluster-wide prefix-cache hit rate: prompt tokens served from cache / prompt tokens
  looked up, summed over the replicas (their ``stats``, before and after the run), and the
  share of prompt tokens loaded from the KV store;
- TTFT p50 / p99 (client side: request sent -> first streamed token);
- each replica's share of the prompt tokens.

The figures go to stdout and ``--json``; conditions (machine, date, workload) with them.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.bench.stats import percentiles

SETTINGS: dict[str, dict[str, Any]] = {
    "1 replica": {"num_replicas": 1, "request_router": "pow2"},
    "2 replicas prefix_aware": {"num_replicas": 2, "request_router": "prefix_aware"},
    "2 replicas pow2": {"num_replicas": 2, "request_router": "pow2"},
    "1 replica, KV store": {"num_replicas": 1, "request_router": "pow2", "kv_store": True},
    "2 replicas pow2, KV store": {"num_replicas": 2, "request_router": "pow2", "kv_store": True},
}
DEFAULT_SETTINGS = ("1 replica", "2 replicas prefix_aware", "2 replicas pow2")


@dataclass(frozen=True)
class PrefixWorkload:
    num_prefixes: int = 8
    prefix_tokens: int = 512  # approximately: measured with the model's /tokenize
    suffix_words: int = 24
    num_requests: int = 160
    rate_per_s: float = 2.0  # Poisson arrivals
    max_tokens: int = 8
    seed: int = 0

    def check(self) -> None:
        for name in ("num_prefixes", "prefix_tokens", "num_requests", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.rate_per_s <= 0:
            raise ValueError("rate_per_s: must be > 0")


async def build_prefixes(client: Any, model: str, workload: PrefixWorkload) -> list[str]:
    """``num_prefixes`` distinct system prompts of about ``prefix_tokens`` tokens each."""
    rng = random.Random(workload.seed)
    words = [f"{w}{i}" for i in range(50) for w in ("alpha", "delta", "omega", "sigma")]
    prefixes = []
    for p in range(workload.num_prefixes):
        text = f"System prompt {p}: " + " ".join(rng.choice(words) for _ in range(400))
        response = await client.post("/tokenize", json={"model": model, "prompt": text})
        count = response.json()["count"]
        keep = max(1, int(len(text) * workload.prefix_tokens / count))
        prefixes.append(text[:keep])
    return prefixes


def schedule(workload: PrefixWorkload, prefixes: list[str]) -> list[tuple[float, str]]:
    """(send time, prompt) per request: exponential gaps, a uniformly drawn prefix."""
    rng = random.Random(workload.seed + 1)
    at = 0.0
    plan = []
    for i in range(workload.num_requests):
        at += rng.expovariate(workload.rate_per_s)
        question = " ".join(f"q{rng.randrange(1000)}" for _ in range(workload.suffix_words))
        plan.append((at, f"{rng.choice(prefixes)}\nUser {i}: {question}"))
    return plan


async def _one(client: Any, model: str, prompt: str, max_tokens: int) -> float | None:
    """TTFT of one streamed completion, or None if it failed."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    start = time.monotonic()
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - start
    return first


async def run_workload(
    base_url: str, model: str, workload: PrefixWorkload, prefixes: list[str] | None = None
) -> dict[str, Any]:
    """Send the workload; TTFTs and failures (the replicas' counters are read around it)."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        prefixes = prefixes or await build_prefixes(client, model, workload)
        start = time.monotonic()

        async def at(when: float, prompt: str) -> float | None:
            await asyncio.sleep(max(0.0, start + when - time.monotonic()))
            return await _one(client, model, prompt, workload.max_tokens)

        plan = schedule(workload, prefixes)
        ttfts = await asyncio.gather(*(at(when, prompt) for when, prompt in plan))
    ok = [t for t in ttfts if t is not None]
    return {"requests": len(ttfts), "failed": len(ttfts) - len(ok), "ttft_s": _ttft(ok)}


def _ttft(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {**percentiles(values, (0.5, 0.99), 4), "mean": round(sum(values) / len(values), 4)}


def cache_summary(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """Cluster-wide hit rate and per-replica prompt-token shares from two ``stats`` rounds."""
    start = {s["replica_id"]: s for s in before}
    queries = {}
    hits = {}
    stored = 0  # prompt tokens loaded from the KV store (kv_transfer_config), all replicas
    for s in after:
        b = start.get(s["replica_id"], {})
        queries[s["replica_id"]] = s["prefix_cache_queries"] - b.get("prefix_cache_queries", 0)
        hits[s["replica_id"]] = s["prefix_cache_hits"] - b.get("prefix_cache_hits", 0)
        stored += s["external_prefix_cache_hits"] - b.get("external_prefix_cache_hits", 0)
    total = sum(queries.values())
    return {
        "prefix_hit_rate": round(sum(hits.values()) / total, 4) if total else 0.0,
        "store_hit_rate": round(stored / total, 4) if total else 0.0,
        "prompt_tokens": total,
        "replica_share": {r: round(q / total, 3) if total else 0.0 for r, q in queries.items()},
        "replica_hit_rate": {r: round(hits[r] / q, 4) if q else 0.0 for r, q in queries.items()},
    }


def setting_config(
    base: dict[str, Any], setting: dict[str, Any], store: str | None = None
) -> dict[str, Any]:
    """The deployment of one setting; ``store``: the KV store's directory when it has one."""
    config = copy.deepcopy(base)
    model = config["models"][0]
    deployment = model.setdefault("deployment_config", {})
    deployment.pop("autoscaling_config", None)
    deployment.update({k: v for k, v in setting.items() if k != "kv_store"})
    if setting.get("kv_store"):
        model["engine_kwargs"]["kv_transfer_config"] = {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"shared_storage_path": store},
        }
    return config


async def bench_setting(
    config_data: dict[str, Any], name: str, workload: PrefixWorkload
) -> dict[str, Any]:
    """Deploy one setting, run the workload, read the replicas, delete the app."""
    from ray import serve

    from cluster.bench.soak import ServeProbe
    from cluster.config import load_config
    from cluster.ops.deploy import deploy, endpoint

    config = load_config(config_data)
    model = config.models[0].model_id
    await asyncio.to_thread(deploy, config, lambda line: print(line, file=sys.stderr))
    try:
        probe = ServeProbe(config.app_name, model)
        before = await asyncio.to_thread(probe.each_replica, "stats")
        base_url = endpoint(config).removesuffix("/v1")
        load = await run_workload(base_url, model, workload)
        after = await asyncio.to_thread(probe.each_replica, "stats")
    finally:
        serve.delete(config.app_name)
    return {"setting": name, **load, **cache_summary(before, after)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=Path("configs/tiny.yaml"))
    parser.add_argument(
        "--model-source", default=None, help="serve this checkpoint, not the config's"
    )
    defaults = PrefixWorkload()
    parser.add_argument("--num-prefixes", type=int, default=defaults.num_prefixes)
    parser.add_argument("--prefix-tokens", type=int, default=defaults.prefix_tokens)
    parser.add_argument("--requests", type=int, default=defaults.num_requests)
    parser.add_argument("--rate", type=float, default=defaults.rate_per_s)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--num-kv-blocks", type=int, default=1024,
                        help="per replica; enough for every prefix on one replica")  # fmt: skip
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS),
                        default=list(DEFAULT_SETTINGS))  # fmt: skip
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    from cluster.config import load_config
    from cluster.ops.deploy import connect, spare_port

    workload = PrefixWorkload(
        num_prefixes=args.num_prefixes,
        prefix_tokens=args.prefix_tokens,
        num_requests=args.requests,
        rate_per_s=args.rate,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    try:
        workload.check()
    except ValueError as exc:
        raise SystemExit(f"bench prefix: {exc}") from None
    base = yaml.safe_load(args.config.read_text())
    base["models"][0].setdefault("engine_kwargs", {})["num_kv_blocks"] = args.num_kv_blocks
    if args.model_source:
        base["models"][0]["model_loading_config"]["model_source"] = args.model_source
    base.setdefault("http_options", {})["port"] = spare_port()
    base.pop("grpc_options", None)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    stores = {name: tempfile.mkdtemp(prefix="bench-kv-", dir=shm) for name in args.settings}
    configs = {name: setting_config(base, SETTINGS[name], stores[name]) for name in args.settings}
    cpus = max(load_config(c).models[0].cpus_at_max_scale() for c in configs.values())
    connect("local", num_cpus=cpus)
    import ray
    from ray import serve

    results = []
    try:
        for name, config in configs.items():
            results.append(asyncio.run(bench_setting(config, name, workload)))
            print(json.dumps(results[-1]), file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
        for store in stores.values():
            shutil.rmtree(store, ignore_errors=True)
    report = {
        "conditions": {
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}",
            "config": str(args.config),
            "model_source": args.model_source,
            "num_kv_blocks": args.num_kv_blocks,
            **asdict(workload),
        },
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.bench.prefix", description=__doc__)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
