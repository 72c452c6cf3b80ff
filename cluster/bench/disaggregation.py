"""``cluster bench pd``: decode latency while long prompts arrive, colocated against
prefill/decode disaggregation (a model's ``disaggregation`` section, the node's KV store
between the pools), each setting deployed alone on a new local Ray.

Workload: ``streams`` steady generations (short prompts, ``stream_tokens`` tokens each,
``ignore_eos``) run back to back for the whole run while long prompts (``long_tokens`` tokens,
one token out) arrive at ``long_rate`` per second. Reports per setting: the steady streams'
inter-token latency (ITL: the gaps between streamed tokens) p50 / p99 and their throughput,
the long prompts' TTFT p50 / p99, and the prompt tokens the decode pool loaded from the store;
plus, once, the time per block of each transport (``transfer_per_block``: the store's write
and read of one block's bytes of the model; NIXL's read of the same block shape). Figures
to stdout and ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import itertools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.bench.stats import percentiles

SETTINGS = ("colocated", "disaggregated")


@dataclass(frozen=True)
class PDWorkload:
    duration_s: float = 60.0
    streams: int = 4
    stream_tokens: int = 64
    long_tokens: int = 1024  # approximately: measured with the model's /tokenize
    long_rate: float = 0.5  # long prompts per second, evenly spaced
    seed: int = 0


def setting_config(base: dict[str, Any], name: str, store: str) -> dict[str, Any]:
    config = copy.deepcopy(base)
    model = config["models"][0]
    model.setdefault("deployment_config", {}).pop("autoscaling_config", None)
    model["deployment_config"]["num_replicas"] = 1
    if name == "disaggregated":
        transfer = {"kv_connector": "SharedStorageConnector",
                    "kv_connector_extra_config": {"shared_storage_path": store}}  # fmt: skip
        model["engine_kwargs"]["kv_transfer_config"] = transfer
        pool = {"deployment_config": model.pop("deployment_config")}  # each pool's, not the model's
        model["disaggregation"] = {"prefill": pool, "decode": copy.deepcopy(pool)}
    return config


async def _long_prompt(client: Any, model: str, tokens: int, index: int) -> str:
    words = " ".join(f"w{(index * 7919 + i) % 5003}" for i in range(tokens))
    text = f"Document {index}: {words}"
    count = (await client.post("/tokenize", json={"model": model, "prompt": text})).json()["count"]
    return text[: max(1, int(len(text) * tokens / count))]


async def _stream(client: Any, body: dict[str, Any]) -> tuple[float | None, list[float]]:
    """(TTFT, token arrival times) of one streamed completion; TTFT None if it failed."""
    start = time.monotonic()
    arrivals: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return None, []
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    return (arrivals[0] - start if arrivals else None), arrivals


async def run_workload(base_url: str, model: str, workload: PDWorkload) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        count = int(workload.duration_s * workload.long_rate)
        longs = [await _long_prompt(client, model, workload.long_tokens, i) for i in range(count)]
        start = time.monotonic()
        gaps: list[float] = []
        tokens = 0

        async def steady(i: int) -> None:
            nonlocal tokens
            n = 0
            while time.monotonic() - start < workload.duration_s:
                body = {"model": model, "prompt": f"Stream {i}.{n}: tell a story", "stream": True,
                        "max_tokens": workload.stream_tokens, "temperature": 0.0,
                        "ignore_eos": True}  # fmt: skip
                _, arrivals = await _stream(client, body)
                gaps.extend(b - a for a, b in itertools.pairwise(arrivals))
                tokens += len(arrivals)
                n += 1

        async def long(i: int) -> float | None:
            await asyncio.sleep(max(0.0, start + i / workload.long_rate - time.monotonic()))
            body = {"model": model, "prompt": longs[i], "max_tokens": 1, "stream": True,
                    "temperature": 0.0}  # fmt: skip
            return (await _stream(client, body))[0]

        results = await asyncio.gather(
            *(steady(i) for i in range(workload.streams)), *(long(i) for i in range(count))
        )
        elapsed = time.monotonic() - start
    ttfts = [t for t in results[workload.streams :] if t is not None]
    return {
        "itl_s": percentiles(gaps, (0.5, 0.99), 4),
        "steady_tokens_per_s": round(tokens / elapsed, 1),
        "long_ttft_s": percentiles(ttfts, (0.5, 0.99), 3),
        "long_prompts": count,
        "long_failed": count - len(ttfts),
    }


def store_time_per_block(config: dict[str, Any], store: str, blocks: int = 64) -> dict[str, Any]:
    """The store's write and read time of one block of this model (its bytes on one worker)."""
    from engine.config import EngineConfig
    from engine.kv_transfer.store import BlockStore
    from engine.worker.memory_plan_weights import kv_bytes_per_token, rank_shape

    model = config["models"][0]
    kwargs = {k: v for k, v in model["engine_kwargs"].items() if k != "kv_transfer_config"}
    engine = EngineConfig.from_kwargs(model=model["model_loading_config"]["model_source"], **kwargs)
    hf, tp = engine.model.hf_config, engine.parallel.tensor_parallel_size
    itemsize = engine.model.torch_dtype.itemsize
    per_token = kv_bytes_per_token(rank_shape(hf, tp), engine.model.num_hidden_layers, itemsize)
    size = per_token * engine.cache.block_size
    blockstore = BlockStore(store, "per-block", [0], 1 << 40)
    data = os.urandom(size)
    start = time.monotonic()
    for i in range(blocks):
        blockstore.write(i.to_bytes(32, "big"), 0, data)
    written = time.monotonic()
    for i in range(blocks):
        if blockstore.read(i.to_bytes(32, "big"), 0, size) is None:
            raise RuntimeError("the store lost a block it had just written")
    read = time.monotonic()
    return {"block_bytes": size, "write_ms": round(1e3 * (written - start) / blocks, 3),
            "read_ms": round(1e3 * (read - written) / blocks, 3)}  # fmt: skip


def nixl_time_per_block(config: dict[str, Any], blocks: int = 64) -> dict[str, Any]:
    """NixlConnector's read time of one block of this model (one worker's caches: every
    layer's K and V), through the decode worker's own read path: ``blocks`` blocks in one
    step's read, and one block alone; two agents of this process (UCX, CPU memory). Skipped
    (``{"skipped": why}``) where NIXL cannot be imported."""
    import torch

    from engine.config import EngineConfig
    from engine.kv_transfer.nixl import nixl_api
    from engine.kv_transfer.nixl_worker import NixlWorkerTransfer
    from engine.kv_transfer.store import kv_head_count

    try:
        nixl_api()
    except ImportError as exc:
        return {"skipped": str(exc)}
    model = config["models"][0]
    kwargs = {k: v for k, v in model["engine_kwargs"].items() if k != "kv_transfer_config"}
    kwargs["kv_transfer_config"] = {"kv_connector": "NixlConnector"}
    source = model["model_loading_config"]["model_source"]
    sides = [EngineConfig.from_kwargs(model=source, **kwargs) for _ in range(2)]
    engine = sides[0]
    hf, tp = engine.model.hf_config, engine.parallel.tensor_parallel_size
    heads = max(1, kv_head_count(hf) // tp)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    shape = (2, blocks, engine.cache.block_size, heads, head_dim)
    layers = engine.model.num_hidden_layers
    dtype = engine.model.torch_dtype
    caches = [[torch.randn(shape).to(dtype) for _ in range(layers)], []]
    caches[1] = [torch.zeros_like(c) for c in caches[0]]
    prefill, decode = (NixlWorkerTransfer(c, 0, 0, tp, layers) for c in sides)
    prefill.register(caches[0])
    decode.register(caches[1])
    src = {"engine_id": sides[0].kv_transfer.engine_id, "workers": [prefill.metadata()]}
    decode.load(caches[1], {"warm-up": [(0, 0)]}, {"warm-up": src})  # connects the agents
    start = time.monotonic()
    failed = decode.load(caches[1], {"r": [(i, i) for i in range(blocks)]}, {"r": src})
    batch = time.monotonic()
    decode.load(caches[1], {"one": [(1, 1)]}, {"one": src})
    single = time.monotonic()
    if failed or any(not torch.equal(a, b) for a, b in zip(*caches, strict=True)):
        raise RuntimeError("NIXL's read did not copy the blocks")
    size = sum(c[:, 0].numel() * c.element_size() for c in caches[0])
    return {"block_bytes": size, "read_ms": round(1e3 * (batch - start) / blocks, 3),
            "read_one_block_ms": round(1e3 * (single - batch), 3)}  # fmt: skip


async def bench_setting(config_data: dict[str, Any], name: str, workload: PDWorkload) -> dict:
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
        load = await run_workload(endpoint(config).removesuffix("/v1"), model, workload)
        after = await asyncio.to_thread(probe.each_replica, "stats")
    finally:
        serve.delete(config.app_name)
    hits = sum(a["external_prefix_cache_hits"] for a in after) - sum(
        b["external_prefix_cache_hits"] for b in before
    )
    return {"setting": name, **load, "decode_tokens_from_store": hits}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = PDWorkload()
    parser.add_argument("--config", type=Path, default=Path("configs/tiny.yaml"))
    parser.add_argument("--model-source", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--duration", type=float, default=defaults.duration_s)
    parser.add_argument("--streams", type=int, default=defaults.streams)
    parser.add_argument("--stream-tokens", type=int, default=defaults.stream_tokens)
    parser.add_argument("--long-tokens", type=int, default=defaults.long_tokens)
    parser.add_argument("--long-rate", type=float, default=defaults.long_rate)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import yaml
    from ray import serve

    from cluster.config import load_config
    from cluster.ops.deploy import connect, spare_port

    workload = PDWorkload(args.duration, args.streams, args.stream_tokens, args.long_tokens,
                          args.long_rate)  # fmt: skip
    base = yaml.safe_load(args.config.read_text())
    kwargs = base["models"][0].setdefault("engine_kwargs", {})
    kwargs.update(num_kv_blocks=args.num_kv_blocks, max_model_len=max(2048, 2 * args.long_tokens))
    if args.dtype:
        kwargs["dtype"] = args.dtype
    if args.model_source:
        base["models"][0]["model_loading_config"]["model_source"] = args.model_source
    base.setdefault("http_options", {})["port"] = spare_port()
    base.pop("grpc_options", None)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    store = tempfile.mkdtemp(prefix="bench-pd-", dir=shm)
    configs = {name: setting_config(base, name, store) for name in args.settings}
    connect("local", num_cpus=max(load_config(c).models[0].cpus_at_max_scale()
                                  for c in configs.values()))  # fmt: skip
    results = []
    try:
        for name, config in configs.items():
            results.append(asyncio.run(bench_setting(config, name, workload)))
            print(json.dumps(results[-1]), file=sys.stderr)
        per_block = store_time_per_block(configs[args.settings[-1]], store)
        nixl_per_block = nixl_time_per_block(configs[args.settings[-1]])
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(store, ignore_errors=True)
    report = {
        "conditions": {
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}",
            "config": str(args.config), "model_source": args.model_source, **asdict(workload),
        },
        "results": results,
        "transfer_per_block": {"SharedStorageConnector": per_block,
                               "NixlConnector": nixl_per_block},
    }  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.bench.disaggregation", description=__doc__
    )
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
