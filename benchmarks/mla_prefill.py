"""What absorbing costs in a latent-attention prefill on CPU: the attention core's share of a
prefill step, and the core absorbed against up-projected at the same sizes.

    python -m benchmarks.mla_prefill [--model DIR] [--lengths 128,512,1024] [--prompts 4]

The engine's MLA (``engine.models.mla``) absorbs W_UK / W_UV in prefill as in decode, so its
attention core runs with keys of ``kv_lora_rank + qk_rope_head_dim`` and values of
``kv_lora_rank`` per head (576 / 512 at DeepSeek-V3's head); up-projecting the latent first
would run it with keys of ``qk_nope_head_dim + qk_rope_head_dim`` and values of ``v_head_dim``
(192 / 128). The absorbed query and output products cost the same multiply-adds as
up-projecting the prompt's own keys and values (``T x H x nope x kv_lora`` each way), so the
attention core is the whole difference. Reports, per prompt length:

- ``step_ms`` / ``core_ms`` / ``core_share``: a prefill of ``--prompts`` prompts of that length
  through the real engine (``LLM.generate``, ``max_tokens=1``, the default bench DeepSeek-V3 in
  float32 unless ``--model``), and the time spent inside the MLA layers' paged attention
  (``PagedAttention.forward``, timed by a wrapper);
- ``absorbed_ms`` / ``up_projected_ms``: one layer's causal attention core over one prompt,
  torch SDPA at the absorbed sizes (one shared latent key, broadcast) and at the up-projected
  sizes, the model's head count; ``saving_share`` is what up-projection would take off the
  step: ``(absorbed - up_projected) * layers * prompts / step``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.models.layers import PagedAttention


def _default_model() -> Path:
    from cluster.bench.model_shape import FAMILY_SHAPES, bench_model_builder
    from engine.builtin.tiny_models import materialize

    shape = FAMILY_SHAPES["deepseek-v3"]
    return materialize(shape.dirname, bench_model_builder(shape))


def _best_ms(fn: Any, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def core_ms(hf: dict[str, Any], length: int) -> tuple[float, float]:
    """One layer's causal attention over one ``length``-token prompt: (absorbed, up-projected)."""
    heads = hf["num_attention_heads"]
    lora, rope = hf["kv_lora_rank"], hf["qk_rope_head_dim"]
    nope, v = hf["qk_nope_head_dim"], hf["v_head_dim"]
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    q_abs = randn(1, heads, length, lora + rope)
    latent = randn(1, 1, length, lora + rope)
    q_up = randn(1, heads, length, nope + rope)
    k_up = randn(1, heads, length, nope + rope)
    v_up = randn(1, heads, length, v)

    def absorbed() -> torch.Tensor:
        k = latent.expand(1, heads, length, lora + rope)
        return F.scaled_dot_product_attention(q_abs, k, k[..., :lora], is_causal=True)

    def up_projected() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_up, k_up, v_up, is_causal=True)

    return _best_ms(absorbed), _best_ms(up_projected)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--lengths", default="128,512,1024")
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    model = args.model or _default_model()
    hf = json.loads((model / "config.json").read_text())
    if "kv_lora_rank" not in hf:
        raise SystemExit(f"{model}: not a latent-attention (DeepSeek-V2/V3) checkpoint")
    lengths = [int(n) for n in args.lengths.split(",")]

    spent = [0.0]
    inner = PagedAttention.forward

    def timed(self: PagedAttention, *a: Any, **kw: Any) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return inner(self, *a, **kw)
        finally:
            spent[0] += time.perf_counter() - start

    llm = LLM(
        model=str(model),
        dtype="float32",
        max_model_len=max(lengths) + 8,
        max_num_batched_tokens=max(lengths) * args.prompts,
        enable_prefix_caching=False,
    )
    PagedAttention.forward = timed  # type: ignore[method-assign]
    rows = []
    g = torch.Generator().manual_seed(1)
    vocab = hf["vocab_size"]
    for length in lengths:
        prompts = [
            {"prompt_token_ids": torch.randint(10, vocab, (length,), generator=g).tolist()}
            for _ in range(args.prompts)
        ]
        params = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate(prompts, params, use_tqdm=False)  # warm
        best_step, best_core = float("inf"), 0.0
        for _ in range(3):
            spent[0] = 0.0
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            step = time.perf_counter() - start
            if step < best_step:
                best_step, best_core = step, spent[0]
        absorbed, up = core_ms(hf, length)
        layers = hf["num_hidden_layers"]
        rows.append(
            {
                "length": length,
                "prompts": args.prompts,
                "step_ms": round(best_step * 1e3, 1),
                "core_ms": round(best_core * 1e3, 1),
                "core_share": round(best_core / best_step, 3),
                "absorbed_ms": round(absorbed, 3),
                "up_projected_ms": round(up, 3),
                "saving_share": round(
                    (absorbed - up) * layers * args.prompts / (best_step * 1e3), 3
                ),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    PagedAttention.forward = inner  # type: ignore[method-assign]
    print(json.dumps({"model": str(model), "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
