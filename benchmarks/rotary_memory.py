"""Rotary cos/sin table bytes per GPU: Llama-3.1-70B on one rank of TP 4 x PP 2.

    python benchmarks/rotary_memory.py [--json rotary_memory.json]

Builds the engine's ``LlamaForCausalLM`` (``engine.models.get_model_class``) as TP rank 0 of
pipeline stage 0 on the meta device: nothing is allocated, and no torch.distributed is needed
because constructing the parallel layers reads only each group's rank and size. Then reports

- ``before_bytes``: the rotary tables the stage's attention layers use, counted once per
  layer: what one table per layer costs (today's scheme);
- ``model_distinct_bytes``: the distinct rotary tables in the built model, each buffer object
  counted once (``data_ptr`` is 0 for every meta tensor, so identity is what tells them
  apart). It equals ``before_bytes`` until the model builds its rotary through ``RopeCache``,
  then ``rope_cache_bytes``;
- ``rope_cache_bytes``: what ``engine.models.rotary.RopeCache`` holds when every layer of the
  stage asks it for its rope: one table for the whole stage.

Prints the conditions with the figures as JSON; ``--json`` also writes them to a file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.models import get_model_class
from engine.models.rotary import RopeCache
from engine.rope_config import check_rope, rope_max_positions, rope_parameters
from llm_kernels.backend import get_kernel_ops
from parallel.state import GroupCoordinator, ParallelContext

TP, PP = 4, 2
LLAMA_31_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
GIB = 1 << 30


def rank_context(tp_rank: int = 0, pp_rank: int = 0) -> ParallelContext:
    """The groups of one rank, without process groups: only rank and size are read while
    the model is built (collectives would need ``group``)."""
    tp = GroupCoordinator(rank=tp_rank, size=TP, ranks=tuple(range(TP)))
    pp = GroupCoordinator(rank=pp_rank, size=PP, ranks=tuple(s * TP for s in range(PP)))
    return ParallelContext(tp=tp, pp=pp)


def rotary_uses(model: nn.Module) -> dict[int, nn.Module]:
    """Decoder layer index -> its rotary module (a module shared by N layers appears N
    times), found by its cos/sin buffers under ``...layers.<index>...``."""
    uses = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if "cos" in module._buffers and "sin" in module._buffers:
            parts = name.split(".")
            uses[int(parts[parts.index("layers") + 1])] = module
    return uses


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measure(hf: dict[str, Any], ctx: ParallelContext) -> dict[str, Any]:
    check_rope(hf)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = get_model_class(hf["architectures"][0])(hf, ctx)
    finally:
        torch.set_default_dtype(previous)
    uses = rotary_uses(model)
    tables = {id(t): t for m in uses.values() for t in (m.cos, m.sin)}

    cache = RopeCache()
    max_position = rope_max_positions(hf)
    head_dim = hf["head_dim"]
    layer_types = hf.get("layer_types") or [None] * hf["num_hidden_layers"]
    with torch.device("meta"):
        for layer in uses:
            params = rope_parameters(hf, layer_types[layer])
            cache.get(head_dim, max_position, params, get_kernel_ops("torch"))

    before = sum(_bytes(m.cos) + _bytes(m.sin) for m in uses.values())
    first = next(iter(uses.values()))
    distinct = sum(_bytes(t) for t in tables.values())
    return {
        "attention_layers_on_rank": len(uses),
        "layers": [min(uses), max(uses) + 1],
        "table_shape": list(first.cos.shape),
        "rope_max_positions": max_position,
        "before_bytes": before,
        "before_gib": before / GIB,
        "model_distinct_buffers": len(tables),
        "model_distinct_bytes": distinct,
        "model_distinct_gib": distinct / GIB,
        "rope_cache_buffers": 2 * len(cache),
        "rope_cache_bytes": cache.buffer_bytes(),
        "rope_cache_gib": cache.buffer_bytes() / GIB,
        "weight_bytes_bf16": sum(_bytes(p) for p in model.parameters()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    result = {
        "conditions": {
            "model": "Llama-3.1-70B (config only, meta device)",
            "tensor_parallel_size": TP,
            "pipeline_parallel_size": PP,
            "rank": {"tp": 0, "pp": 0},
            "rope": rope_parameters(LLAMA_31_70B),
            "table_dtype": "float32",
            "torch": torch.__version__,
        },
        "per_gpu": measure(LLAMA_31_70B, rank_context()),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
