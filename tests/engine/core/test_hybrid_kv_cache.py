"""Sliding-window models on hybrid KV cache groups: greedy output equals HF transformers token
for token (fp32) at lengths well past the window, with chunked prefill, preemption (recompute
and swap) and prefix caching on at once, while the sliding layers hold only their window.

Models: a Gemma-3 shape (5 sliding layers per full one, window 16 = max_model_len / 32),
gpt-oss (window 8 on alternating layers, sinks) and a Mistral with a window of 32 on every
layer (one sliding group, no full one)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_models import tiny_variant
from engine.core.kv_cache_groups import KVCacheGroupSpec
from tests.engine.models.test_correctness import _hf_greedy
from tests.engine.spec_decode.spec_decode_models import draft, ngram

MAX_MODEL_LEN = 512
SLIDING, FULL = "sliding_attention", "full_attention"


def gemma3_5_to_1() -> Path:
    return tiny_variant(
        "tiny-gemma3",
        num_hidden_layers=6,
        sliding_window=16,
        layer_types=[SLIDING] * 5 + [FULL],
    )


# name -> (checkpoint, windows of its groups, KV blocks that force preemption)
MODELS: dict[str, tuple[Any, tuple[int | None, ...], int]] = {
    "gemma3-5-to-1": (gemma3_5_to_1, (None, 16), 20),
    "gpt-oss": (lambda: resolve_model_source("builtin:tiny-gpt-oss"), (None, 8), 20),
    "mistral-window-32": (lambda: tiny_variant("tiny-mistral", sliding_window=32), (32,), 12),
}


class Reference:
    def __init__(self, name: str) -> None:
        build, self.windows, self.num_kv_blocks = MODELS[name]
        self.path = build()
        hf = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        rng = random.Random(11)
        vocab = hf.config.vocab_size
        prefix = [rng.randrange(5, vocab) for _ in range(80)]
        # Past the window many times over; the last three share an 80-token prefix, which the
        # prefix cache serves once the first of them has computed it.
        self.prompts = [
            (prefix if i >= 2 else []) + [rng.randrange(5, vocab) for _ in range(n)]
            for i, n in enumerate((150, 9, 70, 20, 45))
        ]
        self.max_tokens = [32, 40, 24, 32, 40]
        with torch.no_grad():
            self.expected = [_hf_greedy(hf, p, m) for p, m in zip(self.prompts, self.max_tokens)]


@pytest.fixture(scope="module", params=list(MODELS))
def ref(request: pytest.FixtureRequest) -> Reference:
    return Reference(request.param)


def _run(
    ref: Reference, prompts: list[int] | None = None, **engine_args: Any
) -> tuple[LLM, list[list[int]]]:
    """The engine's greedy tokens for the reference's prompts (those at ``prompts``: all)."""
    chosen = range(len(ref.prompts)) if prompts is None else prompts
    llm = LLM(
        str(ref.path),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        num_kv_blocks=ref.num_kv_blocks,
        enable_prefix_caching=True,
        **engine_args,
    )
    params = [SamplingParams(temperature=0, max_tokens=ref.max_tokens[i]) for i in chosen]
    inputs = [{"prompt_token_ids": ref.prompts[i]} for i in chosen]
    done = llm.generate(inputs, params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in done]


def _check_groups(llm: LLM, ref: Reference) -> None:
    engine = llm.llm_engine
    layout = engine.block_manager.layout
    assert tuple(s.sliding_window for s in layout.specs) == ref.windows
    assert layout.specs[-1] == KVCacheGroupSpec(ref.windows[-1])
    engine.check_integrity()
    stats = engine.get_kv_cache_stats()
    assert stats.used == 0, f"{stats.used} blocks still held"


# The native CPU decode kernel (where it builds) with recompute, the torch path with swap.
@pytest.mark.parametrize(("preemption_mode", "backend"), [("recompute", "auto"), ("swap", "torch")])
def test_greedy_matches_hf_past_the_window(
    ref: Reference, preemption_mode: str, backend: str
) -> None:
    llm, got = _run(
        ref, preemption_mode=preemption_mode, swap_space=0.05, attention_backend=backend
    )
    for i, (g, e) in enumerate(zip(got, ref.expected)):
        assert g == e, f"prompt {i} (len {len(ref.prompts[i])}) differs"
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0, "the setting did not force preemption"
    if preemption_mode == "swap":
        assert engine.scheduler.num_swap_outs > 0, "preemption fell back to recompute"
    assert engine.block_manager.prefix_hits > 0
    _check_groups(llm, ref)


@pytest.mark.slow
def test_triton_path_reads_only_held_blocks(ref: Reference) -> None:
    """A Triton program starts at the key tile holding its first query's window, which may
    begin in a freed block: it must read the null block there (Triton interpreter on CPU)."""
    if ref.windows != (None, 16):
        pytest.skip("one model is enough for the (slow) interpreter")
    # The longest prompt (150 tokens, windows of 16) and one on the shared prefix: enough
    # freed blocks under a window's first tile, at half the interpreter's time.
    llm, got = _run(ref, [0, 3], attention_backend="triton")
    assert got == [ref.expected[0], ref.expected[3]]
    _check_groups(llm, ref)


def test_draft_model_speculation_and_forks_on_groups(ref: Reference) -> None:
    """The model as its own draft (its layers join their window's group, every proposal is
    accepted or, at a rejection, rewritten), n = 2 greedy samples forked from one prompt
    (shared blocks, copy-on-write in each group), and n-gram proposals: all equal HF."""
    if ref.windows != (None, 16):
        pytest.skip("one model is enough for these paths")
    llm, got = _run(ref, speculative_config=draft(ref.path, 2))
    assert got == ref.expected
    _check_groups(llm, ref)
    llm, got = _run(ref, speculative_config=ngram(3))
    assert got == ref.expected
    _check_groups(llm, ref)
    params = [SamplingParams(temperature=0, max_tokens=m, n=2) for m in ref.max_tokens]
    done = llm.generate([{"prompt_token_ids": p} for p in ref.prompts], params, use_tqdm=False)
    for output, expected in zip(done, ref.expected):
        assert [list(c.token_ids) for c in output.outputs] == [expected, expected]
    _check_groups(llm, ref)
