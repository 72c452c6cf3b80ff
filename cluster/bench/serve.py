"""``cluster bench serve``: online serving benchmark against any OpenAI-compatible endpoint.

Requests (random token-id prompts, lengths uniform in ranges, ``ignore_eos``) arrive as a
gamma process at ``--request-rate`` (burstiness 1 = Poisson; ``inf`` = all at once), optionally
capped at ``--max-concurrency`` in flight. Every request streams; the client records the time of
its first token and of every later chunk. Reported: TTFT, TPOT, inter-token latency and
end-to-end latency (mean, p50, p90, p99), request and token throughput, goodput under SLOs and
failures — printed, written as JSON, and plotted as PNG.

``--compare CONFIG`` runs the same load twice: in-process against ``AsyncLLMEngine`` (no HTTP,
no Ray), then through Ray Serve deployed from the same config, and reports the serving path's
overhead (throughput ratio, added TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import platform
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from cluster.bench.workload import token_range


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class RequestRecord:
    start: float
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# A sender streams one request and yields (arrival time of a chunk, tokens in it); a time of
# None only corrects the token count (the usage chunk), it is not a chunk of text.
Sender = Callable[[BenchRequest], AsyncIterator[tuple[float | None, int]]]


def make_requests(
    num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(
            [rng.randrange(5, vocab) for _ in range(rng.randint(*input_len))],
            rng.randint(*output_len),
        )
        for _ in range(num)
    ]


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between arrivals: gamma(shape=burstiness, mean=1/rate); Poisson when burstiness=1."""
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num).tolist()


async def run_load(
    send: Sender,
    requests: list[BenchRequest],
    *,
    rate: float,
    burstiness: float,
    max_concurrency: int | None,
    seed: int,
    desc: str,
) -> tuple[list[RequestRecord], float]:
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, unit="req")

    async def one(request: BenchRequest) -> RequestRecord:
        if gate is not None:
            await gate.acquire()
        record = RequestRecord(start=time.perf_counter())
        try:
            async for at, tokens in send(request):
                if at is not None:
                    record.chunk_times.append(at)
                record.output_tokens += tokens
        except Exception as exc:  # a failed request is a measurement, not a crash
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            record.end = time.perf_counter()
            if gate is not None:
                gate.release()
            bar.update(1)
        return record

    tasks = []
    start = time.perf_counter()
    for request, gap in zip(requests, arrival_gaps(len(requests), rate, burstiness, seed)):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(request)))
    records = await asyncio.gather(*tasks)
    bar.close()
    return list(records), time.perf_counter() - start


# ---- senders ---------------------------------------------------------------------------------


def http_sender(base_url: str, model: str, api_key: str | None, session: Any) -> Sender:
    """Streams ``POST {base_url}/completions`` and parses SSE; token counts come from the
    usage chunk (``stream_options.include_usage``), so a chunk's token count is exact."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def send(request: BenchRequest) -> AsyncIterator[tuple[float | None, int]]:
        body = {
            "model": model, "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        async with session.post(f"{base_url}/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            chunks = 0
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(data["error"].get("message"))
                if data.get("usage"):
                    # A chunk may carry several tokens: the exact count comes from usage.
                    yield None, data["usage"]["completion_tokens"] - chunks
                    continue
                if data.get("choices") and data["choices"][0].get("text"):
                    chunks += 1
                    yield time.perf_counter(), 1

    return send


def engine_sender(engine: Any) -> Sender:
    """Drives ``AsyncLLMEngine.generate`` directly: the same engine without HTTP or Ray."""
    from engine.sampling_params import SamplingParams

    counter = iter(range(1 << 62))

    async def send(request: BenchRequest) -> AsyncIterator[tuple[float | None, int]]:
        params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
        stream = engine.generate(
            {"prompt_token_ids": request.prompt_token_ids}, params, f"bench-{next(counter)}"
        )
        async for item in stream:
            if item.delta_token_ids:
                yield time.perf_counter(), len(item.delta_token_ids)

    return send


# ---- metrics ---------------------------------------------------------------------------------


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    arr = np.asarray(values) * 1000.0
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
    }


def summarize(
    records: list[RequestRecord],
    requests: list[BenchRequest],
    duration: float,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
) -> dict[str, Any]:
    ok = [(r, q) for r, q in zip(records, requests) if r.ok]
    output_tokens = sum(r.output_tokens for r, _ in ok)
    prompt_tokens = sum(len(q.prompt_token_ids) for _, q in ok)
    itls = [b - a for r, _ in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpots = [t for r, _ in ok if (t := r.tpot) is not None]
    good = [
        r for r, _ in ok
        if r.ttft * 1000 <= slo_ttft_ms and (r.tpot is None or r.tpot * 1000 <= slo_tpot_ms)
    ]  # fmt: skip
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        "goodput_requests_per_s": len(good) / duration,
        "ttft_ms": _stats_ms([r.ttft for r, _ in ok]),
        "tpot_ms": _stats_ms(tpots),
        "itl_ms": _stats_ms(itls),
        "e2e_ms": _stats_ms([r.e2e for r, _ in ok]),
    }


def plot(runs: dict[str, tuple[list[RequestRecord], float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, (records, _) in runs.items():
        ok = [r for r in records if r.ok]
        for ax, values in (
            (axes[0], [r.ttft * 1000 for r in ok]),
            (axes[1], [r.e2e * 1000 for r in ok]),
        ):
            ax.hist(values, bins=30, alpha=0.6, label=name)
        t0 = min(r.start for r in records)
        times = np.concatenate([np.asarray(r.chunk_times) - t0 for r in ok]) if ok else np.zeros(0)
        if times.size:
            # ~40 bins per run, so a short run is a curve too, not a single point.
            width = max(float(times.max()) / 40, 0.01)
            counts, edges = np.histogram(times, bins=np.arange(0, times.max() + width, width))
            axes[2].plot(edges[:-1], counts / width, label=name)
    for ax, title, xlabel in (
        (axes[0], "time to first token", "ms"),
        (axes[1], "end-to-end latency", "ms"),
        (axes[2], "streamed tokens per second", "s since start"),
    ):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- driver ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="model name (default: the first served)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        metavar="CONFIG",
        help="run in-process and through Ray Serve from this deployment YAML",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=token_range, default=(16, 64), metavar="LO:HI")
    parser.add_argument("--output-len", type=token_range, default=(16, 64), metavar="LO:HI")
    parser.add_argument(
        "--vocab-size", type=int, default=1000, help="prompt ids are drawn below it"
    )
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="req/s; inf = all at once"
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG of latency and throughput")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.burstiness <= 0:
        raise SystemExit("--burstiness: must be > 0")
    requests = make_requests(args.num_prompts, args.input_len, args.output_len, args.vocab_size,
                             args.seed)  # fmt: skip
    load = {"rate": args.request_rate, "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency, "seed": args.seed}  # fmt: skip
    runs = asyncio.run(
        _compare(args, requests, load) if args.compare else _remote(args, requests, load)
    )
    results = {
        name: summarize(records, requests, duration, args.slo_ttft_ms, args.slo_tpot_ms)
        for name, (records, duration) in runs.items()
    }
    report: dict[str, Any] = {"results": results, "conditions": _conditions(args)}
    if {"in_process", "ray_serve"} <= set(results):
        local, served = results["in_process"], results["ray_serve"]
        report["overhead"] = {
            "throughput_ratio_serve_vs_in_process": served["output_token_throughput"]
            / local["output_token_throughput"],
            "added_ttft_p50_ms": served["ttft_ms"]["p50"] - local["ttft_ms"]["p50"],
        }
    _print(report)
    if args.plot:
        plot(runs, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return report


async def _remote(args: argparse.Namespace, requests: list[BenchRequest], load: dict[str, Any]):
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model = args.model or await _first_model(session, args.base_url, args.api_key)
        send = http_sender(args.base_url, model, args.api_key, session)
        return {"endpoint": await run_load(send, requests, desc="endpoint", **load)}


async def _first_model(session: Any, base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(f"{base_url}/models", headers=headers) as resp:
        data = await resp.json()
    return data["data"][0]["id"]


async def _compare(args: argparse.Namespace, requests: list[BenchRequest], load: dict[str, Any]):
    from cluster.config import load_config
    from engine.client.async_llm_engine import AsyncLLMEngine

    config = load_config(args.compare)
    model = config.models[0]
    runs = {}
    engine = AsyncLLMEngine.from_engine_args(**model.engine_args())
    try:
        await run_load(engine_sender(engine), requests[:2], **{**load, "seed": load["seed"] + 1},
                       desc="warm-up")  # fmt: skip
        runs["in_process"] = await run_load(
            engine_sender(engine), requests, desc="in-process", **load
        )
    finally:
        engine.shutdown()
    runs["ray_serve"] = await _through_serve(config, model.model_id, args, requests, load)
    return runs


async def _through_serve(
    config: Any,
    model_id: str,
    args: argparse.Namespace,
    requests: list[BenchRequest],
    load: dict[str, Any],
):
    import aiohttp
    import ray
    from ray import serve

    from cluster.ops.deploy import connect, deploy, endpoint

    connect("local")  # its own Ray: never a stale or foreign cluster found on this machine
    try:
        await asyncio.to_thread(deploy, config, lambda _msg: None)
        base_url = endpoint(config)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            send = http_sender(base_url, model_id, args.api_key, session)
            await run_load(send, requests[:2], **{**load, "seed": load["seed"] + 1}, desc="warm-up")
            return await run_load(send, requests, desc="ray-serve", **load)
    finally:
        serve.shutdown()
        ray.shutdown()


def _conditions(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "target": str(args.compare) if args.compare else args.base_url,
        "num_prompts": args.num_prompts,
        "input_len": list(args.input_len),
        "output_len": list(args.output_len),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "seed": args.seed,
    }


def _print(report: dict[str, Any]) -> None:
    c = report["conditions"]
    print(
        f"\n{c['date']} {c['machine']}  target {c['target']}  {c['num_prompts']} requests, "
        f"rate {c['request_rate']}, burstiness {c['burstiness']}, "
        f"max concurrency {c['max_concurrency']}"
    )
    for name, r in report["results"].items():
        print(
            f"[{name}] ok {r['completed']} failed {r['failed']}  "
            f"{r['request_throughput']:.2f} req/s  {r['output_token_throughput']:.1f} out tok/s  "
            f"goodput {r['goodput_requests_per_s']:.2f} req/s"
        )
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = r[metric]
            print(
                f"    {metric:<7} mean {s['mean']:8.1f}  p50 {s['p50']:8.1f}  "
                f"p90 {s['p90']:8.1f}  p99 {s['p99']:8.1f}"
            )
    if "overhead" in report:
        o = report["overhead"]
        print(
            f"serving overhead: Ray Serve / in-process throughput "
            f"{o['throughput_ratio_serve_vs_in_process']:.2f}, added TTFT p50 "
            f"{o['added_ttft_p50_ms']:.1f} ms"
        )
