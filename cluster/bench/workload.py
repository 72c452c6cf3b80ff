"""The offline benchmarks' workload and result: N prompts of random token ids with input and
output lengths uniform in ranges (as vLLM's and nano-vllm's throughput benchmarks), and what a
system did with them (``SystemResult``). Shared by ``cluster bench throughput``, its
baselines (``cluster.bench.hf_baselines``), the roofline and the serving benchmark.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    conditions: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def total_tokens(self) -> int:
        return self.output_tokens + sum(len(p) for p in self.prompts)


def make_workload(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    # Ids above 4 only: the built-in tokenizer's specials (bos, eos, chat markers) stay out.
    prompts = [
        [rng.randrange(5, vocab) for _ in range(rng.randint(*input_len))]
        for _ in range(num_prompts)
    ]
    output_lens = [rng.randint(*output_len) for _ in range(num_prompts)]
    return Workload(prompts, output_lens)


@dataclass
class SystemResult:
    wall_s: float
    output_tokens: int
    total_tokens: int
    requests: int
    # Bytes one token takes in the KV cache (all layers, one worker), where the system says.
    kv_cache_bytes_per_token: int | None = None

    def as_dict(self) -> dict[str, float]:
        out = {
            "output_tokens_per_s": self.output_tokens / self.wall_s,
            "total_tokens_per_s": self.total_tokens / self.wall_s,
            "requests_per_s": self.requests / self.wall_s,
            "wall_s": self.wall_s,
        }
        if self.kv_cache_bytes_per_token is not None:
            out["kv_cache_bytes_per_token"] = self.kv_cache_bytes_per_token
        return out


def token_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 0 < lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 < LO <= HI, got {text!r}")
    return lo_i, hi_i
