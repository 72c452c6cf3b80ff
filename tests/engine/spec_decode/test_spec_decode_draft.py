"""Speculative decoding with a draft model (``method: draft_model``) end to end: greedy outputs
token-for-token equal to decoding without speculation, with the target as its own draft (every
proposal accepted) and with a smaller random draft (other depth and width, same vocabulary and
tokenizer), under chunked prefill, preemption (recompute and swap) and prefix caching, n = 2,
stops, structured outputs and LoRA; KV blocks counted at target + draft bytes; seeded sampling
reproducible and its distribution unchanged (chi-square); vLLM's draft settings at the values
served accepted; a draft the engine cannot use refused naming it. Random Llamas, fp32 on
CPU.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.builtin.tiny_models import make_random_model
from engine.errors import ConfigError
from engine.sampling_params import StructuredOutputsParams
from tests.engine.spec_decode.spec_decode_models import (
    VOCAB,
    alternating_adapters,
    draft,
    generator,
    make_looping_model,
    make_small_draft,
)
from tests.engine.spec_decode.test_spec_decode_sampling import ALPHA, two_sample

rng = random.Random(1)
PROMPTS = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(10)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
BASE: dict[str, Any] = {"device": "cpu", "num_kv_blocks": 256, "max_model_len": 512}
generate = generator(GREEDY, PROMPTS)
SHAPE = {"vocab_size": VOCAB, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_looping_model(tmp_path_factory.mktemp("target") / "m", 512, num_hidden_layers=3)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_small_draft(tmp_path_factory.mktemp("draft") / "d", 1, seed=3,
                            max_position_embeddings=512)  # fmt: skip


@pytest.fixture(scope="module")
def reference(model: Path) -> list[list[int]]:
    return generate(LLM(str(model), **BASE))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_target_as_its_own_draft_is_always_accepted(model, reference, k):
    llm = LLM(str(model), **BASE, speculative_config=draft(model, k))
    assert generate(llm) == reference
    stats = llm.llm_engine.spec_decode_stats
    assert stats.num_draft_tokens > 0
    # Greedy with the target's own argmax: every proposal is the target's next token.
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.accepted_per_pos[0] == stats.num_drafts
    # Each verification emits its k accepted proposals + 1 (fewer only near max_tokens).
    assert stats.num_drafts < sum(len(t) for t in reference) / k
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_smaller_draft_outputs_equal(model, small_draft, reference, k):
    llm = LLM(str(model), **BASE, speculative_config=draft(small_draft, k))
    assert generate(llm) == reference
    stats = llm.llm_engine.spec_decode_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # a different model
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("which", ["self", "small"])
def test_chunked_prefill_small_budget(model, small_draft, reference, which):
    path = model if which == "self" else small_draft
    llm = LLM(str(model), **BASE, max_num_batched_tokens=16, speculative_config=draft(path, 3))
    assert generate(llm) == reference
    stats = llm.llm_engine.spec_decode_stats
    if which == "self":  # every chunk's K/V mirrored: the draft still agrees everywhere
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_preemption_with_a_tiny_kv_cache(model, reference):
    llm = LLM(str(model), **{**BASE, "num_kv_blocks": 14}, speculative_config=draft(model, 4))
    assert generate(llm) == reference
    assert llm.llm_engine.scheduler.num_preemptions > 0
    stats = llm.llm_engine.spec_decode_stats
    # Recomputed requests rebuild the draft's K/V too: proposals stay exact.
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    llm.llm_engine.check_integrity()


def test_swap_preemption_moves_the_drafts_blocks_too(model, reference):
    args = {**BASE, "num_kv_blocks": 14, "preemption_mode": "swap", "swap_space": 0.01}
    llm = LLM(str(model), **args, speculative_config=draft(model, 3))
    assert generate(llm) == reference
    assert llm.llm_engine.scheduler.num_swap_outs > 0
    stats = llm.llm_engine.spec_decode_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    llm.llm_engine.check_integrity()


def test_prefix_caching_hits_carry_the_drafts_kv(model, small_draft, reference):
    llm = LLM(str(model), **BASE, block_size=8, speculative_config=draft(model, 3))
    assert generate(llm) == reference
    longer = [p + t[:24] for p, t in zip(PROMPTS, reference)]
    expect = generate(LLM(str(model), **BASE, enable_prefix_caching=False), prompts=longer)
    hits = llm.llm_engine.block_manager.prefix_hits
    drafted, accepted = (
        llm.llm_engine.spec_decode_stats.num_draft_tokens,
        llm.llm_engine.spec_decode_stats.num_accepted_tokens,
    )
    assert generate(llm, prompts=longer) == expect
    assert llm.llm_engine.block_manager.prefix_hits > hits
    stats = llm.llm_engine.spec_decode_stats
    # Cached blocks hold the draft's K/V of the verified tokens: the draft, reading them
    # instead of computing them, still agrees with the target everywhere.
    assert stats.num_accepted_tokens - accepted == stats.num_draft_tokens - drafted > 0
    llm.llm_engine.check_integrity()


def test_seeded_sampling_reproducible(model, small_draft):
    seeded = SamplingParams(n=2, temperature=0.8, top_k=8, seed=11, max_tokens=24)
    spec = draft(small_draft, 3)
    first = generate(LLM(str(model), **BASE, speculative_config=spec), seeded)
    again = generate(LLM(str(model), **BASE, speculative_config=spec), seeded)
    assert first == again
    assert all(len(t) == 24 for t in first)


def test_vllm_draft_settings_naming_the_served_values_change_nothing(model, small_draft, reference):
    # vLLM's spelling ('-' for '_', nulls as unset) and its draft settings at this engine's values.
    settings = {
        "model": str(small_draft),
        "num-speculative-tokens": 3,
        "method": None,
        "draft_tensor_parallel_size": 1,
        "max_model_len": BASE["max_model_len"],
        "quantization": None,
        "revision": None,
        "enforce_eager": True,
    }
    llm = LLM(str(model), **BASE, speculative_config=settings)
    assert generate(llm) == reference
    assert llm.llm_engine.spec_decode_stats.num_draft_tokens > 0


def test_draft_with_another_vocabulary_is_refused(model, tmp_path):
    other = make_random_model(
        tmp_path / "other",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=VOCAB + 64,
        max_position_embeddings=512,
    )
    with pytest.raises(ConfigError) as info:
        LLM(str(model), **BASE, speculative_config=draft(other, 3))
    message = str(info.value)
    assert message.startswith("speculative_config.model:")
    assert str(other) in message
    assert f"vocab_size {VOCAB + 64}" in message and f"has {VOCAB}" in message


def test_draft_model_needs_a_model(model):
    with pytest.raises(ConfigError, match=r"speculative_config\.model: must name the draft"):
        LLM(
            str(model),
            **BASE,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2},
        )


def test_draft_that_cannot_be_sharded_like_the_target_is_refused(model, tmp_path):
    odd = make_random_model(
        tmp_path / "odd",
        hidden_size=48,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=1,
        intermediate_size=64,
        **SHAPE,
    )
    with pytest.raises(ConfigError) as info:
        LLM(str(model), **BASE, tensor_parallel_size=2, speculative_config=draft(odd, 2))
    message = str(info.value)
    assert message.startswith("speculative_config.model:") and str(odd) in message
    assert "num_attention_heads (3)" in message


def test_kv_blocks_are_counted_at_target_plus_draft_bytes(model, small_draft):
    # cpu_kv_cache_space small enough that it, not max_num_seqs * max_model_len, sets the pool.
    args = {"device": "cpu", "max_model_len": 512, "cpu_kv_cache_space": 0.002}
    plain = LLM(str(model), **args).llm_engine
    spec = LLM(str(model), **args, speculative_config=draft(small_draft, 2)).llm_engine
    target_bytes = sum(plain.executor.collective_rpc("kv_block_bytes"))
    # The draft: 1 layer, 1 KV head of dim 16, K and V, 16 tokens per block, fp32.
    draft_bytes = 1 * 2 * 16 * 1 * 16 * 4
    assert sum(spec.executor.collective_rpc("kv_block_bytes")) == target_bytes + draft_bytes
    space = int(0.002 * 1024**3)
    assert plain.block_manager.num_blocks == space // target_bytes
    assert spec.block_manager.num_blocks == space // (target_bytes + draft_bytes)


def test_parallel_samples_stops_and_structured_outputs(model, small_draft, reference):
    base = LLM(str(model), **BASE)
    llm = LLM(str(model), **BASE, speculative_config=draft(model, 3))
    greedy_n = SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True)
    assert generate(llm, greedy_n) == generate(base, greedy_n)
    stops = sorted({t for out in reference for t in out[5:] if out.count(t) > 1})[:8]
    stop_params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=stops)
    expect = generate(base, stop_params)
    assert any(len(t) < 40 for t in expect)
    assert generate(llm, stop_params) == expect
    choice = SamplingParams(
        temperature=0,
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta gamma"]),
    )
    expect = generate(base, choice, PROMPTS[:4])
    small = LLM(str(model), **BASE, speculative_config=draft(small_draft, 3))
    for spec_llm in (llm, small):
        outs = spec_llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS[:4]], choice, use_tqdm=False
        )
        assert [list(o.outputs[0].token_ids) for o in outs] == expect
        assert all(o.outputs[0].text in ("alpha", "beta gamma") for o in outs)


def test_lora_adapters_with_a_draft(model, tmp_path):
    lora = alternating_adapters(model, tmp_path, len(PROMPTS))
    args = {**BASE, "enable_lora": True, "max_loras": 2}

    def run(llm: LLM) -> list[list[int]]:
        return generate(llm, lora_request=lora)

    # The draft runs without the adapters: proposals may differ, outputs may not.
    llm = LLM(str(model), **args, speculative_config=draft(model, 3))
    assert run(llm) == run(LLM(str(model), **args))
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("which", ["self", "small"])
def test_sampled_distribution_equal_with_and_without_a_draft(model, small_draft, which):
    """Chi-square over 600 seeds of 4-token continuations: the draft's greedy proposals are
    point masses, so the rejection sampler keeps the target's (top-k) distribution."""
    args = {"device": "cpu", "num_kv_blocks": 512, "max_model_len": 256, "max_num_seqs": 256}
    path = model if which == "self" else small_draft
    base = LLM(str(model), **args)
    spec = LLM(str(model), **args, speculative_config=draft(path, 2))
    prompt = {"prompt_token_ids": PROMPTS[0]}
    n = 600
    params = [
        SamplingParams(top_k=3, temperature=0.5, seed=s, max_tokens=4, ignore_eos=True)
        for s in range(n)
    ]
    plain = Counter(tuple(o.outputs[0].token_ids) for o in base.generate([prompt] * n, params))
    specd = Counter(tuple(o.outputs[0].token_ids) for o in spec.generate([prompt] * n, params))
    stats = spec.llm_engine.spec_decode_stats
    if which == "self":  # accepted proposals, and rejections followed by a residual draw
        assert stats.num_accepted_tokens > 10
        assert stats.num_draft_tokens - stats.num_accepted_tokens > 10
    assert two_sample(plain, specd) > ALPHA


def test_profiled_budget_is_split_at_target_plus_draft_bytes_per_block():
    from tests.engine.worker.test_kv_sizing import FakeMemoryProbe, GiB, MiB, sized_worker

    # 256 MiB in use at start: the default 0.9 share (3.6 GiB) is free.
    plain = sized_worker(FakeMemoryProbe(total=4 * GiB, used_outside_torch=256 * MiB))
    spec = {"method": "draft_model", "model": "builtin:tiny-llama", "num_speculative_tokens": 2}
    probe = FakeMemoryProbe(total=4 * GiB, used_outside_torch=256 * MiB)
    worker = sized_worker(probe, speculative_config=spec)
    # The draft's weights are the worker's too (the probe saw them allocated).
    assert worker.parameter_bytes() == 2 * plain.parameter_bytes()
    assert worker.kv_block_bytes() == 2 * plain.kv_block_bytes()
    num_blocks, _ = worker.determine_num_available_blocks()
    budget = worker.kv_budget
    assert budget is not None and budget.weights == worker.parameter_bytes()
    # (The fake probe's hook sees only the target's caches, so the activation peak is not
    # checked to the byte here; test_kv_sizing.py checks it without a draft.)
    assert budget.kv_cache > 2 * GiB
    assert num_blocks == budget.kv_cache // (2 * plain.kv_block_bytes())
    assert worker.runner.draft is not None and worker.runner.draft.kv_caches[0].shape[1] == 0
