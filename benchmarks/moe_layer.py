"""The MoE layer's experts on CPU, before and after grouping tokens by expert: milliseconds per
call and where the time goes (torch.profiler's top operators), at decode and prefill sizes.

    python -m benchmarks.moe_layer [--experts 16] [--top-k 4] [--hidden 768] [--inter 512]

Three ways to compute the same thing (``sum_k w[t, k] * down_e(silu(gate_e x) * up_e x)``):
- ``per_token``: a Python loop over every token and each of its top-k experts (one small GEMV
  pair per (token, expert) pair) — the naive layer;
- ``per_expert_masked``: a loop over every expert, each selecting its tokens with a mask (the
  HF eager layer's shape: E iterations whatever the routing);
- ``grouped``: ``parallel.moe.grouped_experts`` — pairs sorted by expert once, one GEMM pair per
  expert that has tokens, on the plain stacked weights;
- ``grouped_packed``: the same with each expert's weights packed into oneDNN's layout and
  ``packed_linear`` GEMMs (what the engine runs on CPU, ``ParallelExperts.pack_weights``).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llm_kernels.cpu_gemm import pack_linear_weight, packed_linear
from parallel.moe import grouped_experts


def act_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def per_token(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            out[t] += weights[t, k] * (act_and_mul(x[t] @ w13[e].T) @ w2[e].T)
    return out


def per_expert_masked(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel() == 0:
            continue
        hidden = act_and_mul(x[token] @ w13[e].T) @ w2[e].T
        out.index_add_(0, token, hidden * weights[token, slot, None])
    return out


def grouped(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    return grouped_experts(x, w13, w2, ids, weights, act_and_mul)


@functools.cache
def _packed(weights: torch.Tensor) -> list[torch.Tensor]:
    return [pack_linear_weight(w) for w in weights]


def grouped_packed(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    w13_packed, w2_packed = _packed(w13), _packed(w2)
    return grouped_experts(
        x, w13_packed, w2_packed, ids, weights, act_and_mul, linear=packed_linear
    )


VARIANTS: dict[str, Callable[..., torch.Tensor]] = {
    "per_token": per_token,
    "per_expert_masked": per_expert_masked,
    "grouped": grouped,
    "grouped_packed": grouped_packed,
}


def timed(fn: Callable[[], torch.Tensor], min_s: float = 1.0) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1000


def top_ops(fn: Callable[[], torch.Tensor], n: int = 5) -> list[tuple[str, float]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            fn()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [(e.key, round(100 * e.self_cpu_time_total / total, 1)) for e in events[:n]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--tokens", default="1,16,64,512")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(args.experts, 2 * args.inter, args.hidden, generator=gen) * 0.02).to(dtype)
    w2 = (torch.randn(args.experts, args.hidden, args.inter, generator=gen) * 0.02).to(dtype)
    results = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(num_tokens, args.hidden, generator=gen).to(dtype)
        logits = torch.randn(num_tokens, args.experts, generator=gen)
        weights, ids = torch.topk(logits.softmax(-1), args.top_k, dim=-1)
        weights = weights.to(dtype)
        reference = grouped(x, w13, w2, ids, weights).float()
        for name in args.variants.split(","):
            variant = VARIANTS[name]
            if name == "per_token" and num_tokens > 64:
                continue  # minutes, and the trend is clear by 64
            got = variant(x, w13, w2, ids, weights).float()
            err = (got - reference).abs().max().item()
            call = functools.partial(variant, x, w13, w2, ids, weights)
            ms, ops = timed(call), top_ops(call)
            row = {"tokens": num_tokens, "variant": name, "ms": round(ms, 3),
                   "max_abs_diff_vs_grouped": err, "top_ops_self_cpu_pct": ops}  # fmt: skip
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "threads": torch.get_num_threads(), "results": results},
                      f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
