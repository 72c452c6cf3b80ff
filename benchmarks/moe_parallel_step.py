"""Decode step time of a random Qwen3-MoE under TP = 2 (every expert sliced), EP = 2
(``enable_expert_parallel``: whole experts per rank) and DP = 2 x EP 2 (``data_parallel_size``:
each rank its own half of the requests, the routed tokens exchanged per MoE layer), with TP = 1
as the baseline, on CPU/gloo. Every mode computes the same ``--batch`` requests.

Each mode spawns its ranks as plain processes (no Ray: the step itself, not the dispatch), each
rank a ``Worker`` with ``torch.set_num_threads(--threads)``; every rank prefills its prompts of
``--prompt-len`` tokens, then runs ``--warmup`` + ``--steps`` one-token decode steps, timed on
rank 0 (the collectives synchronise the ranks). Within each timed step, rank 0 also times each
layer's attention and MoE block and the collectives issued inside them (all-reduce; the three
all-to-alls of the exchange), by hooks and wrappers in this process only: the step's breakdown
per layer. Besides the step, each rank times ``--steps`` bare gloo all-reduces of one decode
step's ``[batch, hidden]`` activations, and under EP counts the share of (token, expert) pairs
its experts received (load balance).

    python -m benchmarks.moe_parallel_step --runs 2 --json out.json

Prints the conditions with the figures; ``--json`` writes them for a script to read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

from benchmarks.spawned import run_spawned

SHAPE = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 384,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "vocab_size": 8192,
    "max_position_embeddings": 1024,
}
BLOCK_SIZE = 16


MODES = {"tp1": (1, 1), "tp2": (2, 1), "ep2": (2, 1), "dp2": (1, 2)}  # mode -> (TP, DP)


def _requests(
    args: argparse.Namespace, step: int, sampled: list[int] | None, batch: int, first: int = 0
) -> Any:
    """Requests ``first .. first + batch - 1`` of the benchmark: their prefill when ``sampled``
    is None, else decode step ``step`` with the tokens they sampled last."""
    from engine.sampling_params import SamplingParams
    from engine.worker.step_messages import CachedRequestData, ExecuteModelRequest, NewRequestData

    ids = [f"r{i}" for i in range(first, first + batch)]
    blocks = -(-(args.prompt_len + args.warmup + args.steps + 8) // BLOCK_SIZE)
    if sampled is None:
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        return ExecuteModelRequest(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=rid,
                    prompt_token_ids=[(7 * i + 3 * t) % 8000 + 10 for t in range(args.prompt_len)],
                    sampling_params=params,
                    block_ids=list(range(i * blocks, (i + 1) * blocks)),
                    num_computed_tokens=0,
                )
                for i, rid in enumerate(ids, start=first)
            ],
            scheduled_cached_reqs=[],
            num_scheduled_tokens=dict.fromkeys(ids, args.prompt_len),
            total_num_scheduled_tokens=batch * args.prompt_len,
            finished_req_ids=[],
        )
    return ExecuteModelRequest(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[
            CachedRequestData(
                req_id=rid,
                new_token_ids=[t],
                new_block_ids=[],
                num_computed_tokens=args.prompt_len + step,
            )
            for rid, t in zip(ids, sampled)
        ],
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=batch,
        finished_req_ids=[],
    )


class _Breakdown:
    """Milliseconds spent inside every layer's attention and MoE block, and inside the
    collectives (``GroupCoordinator.all_reduce``; ``all_to_all_counts`` and ``all_to_all``,
    counted as one) issued within each, accumulated until ``take`` returns and clears them.
    Forward hooks on the layers' ``self_attn`` and ``mlp``; the collectives wrapped on the
    class, in this (benchmark) process."""

    WRAPPED: ClassVar[dict[str, str]] = {
        "all_reduce": "all_reduce", "all_to_all_counts": "all_to_all", "all_to_all": "all_to_all"
    }  # fmt: skip

    def __init__(self, model: Any) -> None:
        from engine.models.decoder import PreNormDecoderLayer
        from parallel.state import GroupCoordinator

        self.totals: dict[str, float] = {}
        self.region = "other"
        self._started = 0.0
        for layer in model.modules():
            if isinstance(layer, PreNormDecoderLayer):
                for name, module in (("attention", layer.self_attn), ("moe", layer.mlp)):
                    module.register_forward_pre_hook(self._enter(name))
                    module.register_forward_hook(self._leave(name))
        for method, kind in self.WRAPPED.items():
            setattr(GroupCoordinator, method, self._timed(getattr(GroupCoordinator, method), kind))

    def _add(self, key: str, seconds: float) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + seconds * 1e3

    def _enter(self, name: str) -> Any:
        def hook(module: Any, inputs: Any) -> None:
            self.region, self._started = name, time.perf_counter()

        return hook

    def _leave(self, name: str) -> Any:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            self._add(name, time.perf_counter() - self._started)
            self.region = "other"

        return hook

    def _timed(self, method: Any, kind: str) -> Any:
        def timed(group: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(group, *args, **kwargs)
            finally:
                self._add(f"{self.region}.{kind}", time.perf_counter() - start)

        return timed

    def take(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


def _rank_main(rank: int, ports: Any, results: Any, mode: str, model: str,
               args: argparse.Namespace) -> None:  # fmt: skip
    try:
        results.put((rank, _run_rank(rank, mode, model, args, ports)))
    except BaseException as exc:
        results.put((rank, repr(exc)))


def _run_rank(rank: int, mode: str, model: str, args: argparse.Namespace, ports: Any) -> dict:
    import torch
    import torch.distributed as dist

    from engine.config import EngineConfig
    from engine.worker.worker import Worker
    from parallel.moe import ParallelExperts

    torch.set_num_threads(args.threads)
    tp, dp = MODES[mode]
    batch = args.batch // dp  # this DP rank's requests: the same total in every mode
    config = EngineConfig.from_kwargs(
        model=model, dtype="float32", device="cpu", tensor_parallel_size=tp,
        data_parallel_size=dp, enable_expert_parallel=mode in ("ep2", "dp2"),
        num_kv_blocks=args.batch * 64, max_model_len=1024,
    )  # fmt: skip
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, rank=rank))
    worker = Worker(config)
    worker.init_device()
    if tp * dp > 1:
        port = worker.start_rendezvous("127.0.0.1") if rank == 0 else 0
        if rank == 0:
            ports.put(port)
        worker.init_distributed("127.0.0.1", port if rank == 0 else ports.get(timeout=120))
    worker.load_model()
    worker.initialize_cache(args.batch * 64, 0)

    first = (rank // tp) * batch

    def step(request: Any) -> list[int]:
        out = worker.execute_model(request)
        box = [out.sampled_token_ids if out is not None else None]
        if tp > 1:
            dist.broadcast_object_list(box, src=0)
        return [t[0] for t in box[0]]

    sampled = step(_requests(args, 0, None, batch, first))
    breakdown = _Breakdown(worker.runner.model)
    samples, parts = [], []
    for i in range(args.warmup + args.steps):
        breakdown.take()
        start = time.perf_counter()
        sampled = step(_requests(args, i, sampled, batch, first))
        if i >= args.warmup:
            samples.append((time.perf_counter() - start) * 1e3)
            parts.append(breakdown.take())
    result: dict[str, Any] = {"step_ms": samples, "parts_ms": parts}
    if tp > 1:
        x = torch.randn(args.batch, SHAPE["hidden_size"])
        ar = []
        for _ in range(args.steps):
            start = time.perf_counter()
            dist.all_reduce(x, group=worker.ctx.tp.group)
            ar.append((time.perf_counter() - start) * 1e3)
        result["all_reduce_ms"] = ar
    if mode in ("ep2", "dp2"):
        local, total = [0], [0]

        def count(module: ParallelExperts, inputs: tuple[Any, ...]) -> None:
            ids = inputs[1]
            owned = (ids >= module.first_expert) & (
                ids < module.first_expert + module.num_local_experts
            )
            local[0] += int(owned.sum())
            total[0] += ids.numel()

        for m in worker.runner.model.modules():
            if isinstance(m, ParallelExperts):
                m.register_forward_pre_hook(count)
        for i in range(4):
            sampled = step(_requests(args, args.warmup + args.steps + i, sampled, batch, first))
        result["local_pair_share"] = local[0] / max(total[0], 1)
    if tp * dp > 1:
        worker.shutdown()
    return result


def _run_mode(mode: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    tp, dp = MODES[mode]
    out = run_spawned(_rank_main, tp * dp, mode, model, args)
    first = out[0]
    layers = SHAPE["num_hidden_layers"]
    keys = sorted({key for part in first["parts_ms"] for key in part})
    summary = {
        "step_median_ms": statistics.median(first["step_ms"]),
        "step_mean_ms": statistics.fmean(first["step_ms"]),
        # rank 0, median over the timed steps, divided by the layers: ms per layer
        "per_layer_ms": {
            key: statistics.median(part.get(key, 0.0) for part in first["parts_ms"]) / layers
            for key in keys
        },
    }
    if "all_reduce_ms" in first:
        ar = statistics.median(first["all_reduce_ms"])
        summary["all_reduce_median_ms"] = ar
        summary["all_reduces_per_step"] = 2 * SHAPE["num_hidden_layers"]
    if mode in ("ep2", "dp2"):
        summary["local_pair_share"] = [out[r]["local_pair_share"] for r in sorted(out)]
    return summary


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--modes", default="tp1,tp2,ep2,dp2")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from engine.builtin.tiny_moe_models import make_random_qwen3_moe

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_random_qwen3_moe(tmp, **SHAPE))
        runs = [
            {mode: _run_mode(mode, model, args) for mode in args.modes.split(",")}
            for _ in range(args.runs)
        ]
    report = {
        "conditions": {
            "model": {"family": "Qwen3MoeForCausalLM", "random_weights": True, **SHAPE},
            "dtype": "float32",
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "decode_steps_timed": args.steps,
            "warmup_steps": args.warmup,
            "threads_per_rank": args.threads,
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
            "backend": "gloo, spawned processes, no Ray",
        },
        "runs": runs,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
