"""Speculative decoding (n-gram proposals) end to end: greedy outputs token-for-token equal to
decoding without speculation, under chunked prefill, preemption, prefix caching, n > 1, stops
and structured outputs; proposals are accepted (the metrics say how many).

The model is a small random Llama whose greedy outputs fall into loops (HF's 0.02 init,
vocabulary 256), so prompt lookup proposes tokens the target really emits; fp32 on CPU.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, RequestOutputKind, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from tests.engine.spec_decode.spec_decode_models import (
    VOCAB,
    alternating_adapters,
    generator,
    make_looping_model,
    ngram,
)

rng = random.Random(0)
PROMPTS = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(12)]
# Repeated content: the prompt itself gives the proposals before the output loops.
PROMPTS += [[7, 8, 9, 10, 11] * 6, [40, 41, 40, 41, 40, 41, 40]]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
BASE: dict[str, Any] = {"device": "cpu", "num_kv_blocks": 256, "max_model_len": 512}
generate = generator(GREEDY, PROMPTS)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_looping_model(tmp_path_factory.mktemp("spec") / "m", max_position_embeddings=512)


@pytest.fixture(scope="module")
def reference(model: Path) -> list[list[int]]:
    return generate(LLM(str(model), **BASE))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equal_without_speculation_and_proposals_accepted(model, reference, k):
    llm = LLM(str(model), **BASE, speculative_config=ngram(k))
    assert generate(llm) == reference
    stats = llm.llm_engine.spec_decode_stats
    assert stats.num_accepted_tokens > 0
    assert stats.num_draft_tokens >= stats.num_accepted_tokens
    assert len(stats.accepted_per_pos) == k
    # Acceptance is a prefix: position j + 1 is never accepted more often than position j.
    assert all(a >= b for a, b in zip(stats.accepted_per_pos, stats.accepted_per_pos[1:]))
    assert stats.mean_acceptance_length > 1.0
    llm.llm_engine.check_integrity()


def test_fewer_steps_than_tokens_with_speculation(model, reference):
    llm = LLM(str(model), **BASE, speculative_config=ngram(4))
    generate(llm)
    stats = llm.llm_engine.spec_decode_stats
    emitted = sum(len(t) for t in reference)
    # Every verification emits its accepted proposals plus one token.
    assert stats.num_drafts + stats.num_accepted_tokens <= emitted


def test_chunked_prefill_small_budget(model, reference):
    llm = LLM(str(model), **BASE, max_num_batched_tokens=16, speculative_config=ngram(3))
    assert generate(llm) == reference
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0


def test_preemption_with_a_tiny_kv_cache(model, reference):
    args = {**BASE, "num_kv_blocks": 12, "block_size": 16}
    llm = LLM(str(model), **args, speculative_config=ngram(5))
    assert generate(llm) == reference
    assert llm.llm_engine.scheduler.num_preemptions > 0
    llm.llm_engine.check_integrity()


def test_swap_preemption(model, reference):
    args = {**BASE, "num_kv_blocks": 12, "preemption_mode": "swap", "swap_space": 0.01}
    llm = LLM(str(model), **args, speculative_config=ngram(3))
    assert generate(llm) == reference
    assert llm.llm_engine.scheduler.num_swap_outs > 0
    llm.llm_engine.check_integrity()


def test_lora_adapters_with_speculation(model, tmp_path):
    lora = alternating_adapters(model, tmp_path, len(PROMPTS))
    args = {**BASE, "enable_lora": True, "max_loras": 2}

    def run(llm: LLM) -> list[list[int]]:
        return generate(llm, lora_request=lora)

    llm = LLM(str(model), **args, speculative_config=ngram(3))
    assert run(llm) == run(LLM(str(model), **args))
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0


def test_prefix_caching_only_caches_verified_tokens(model, reference):
    llm = LLM(str(model), **BASE, block_size=8, speculative_config=ngram(5))
    assert generate(llm) == reference
    # Prompts extended by their verified outputs hit the cache of the blocks written above;
    # a block holding a rejected proposal's K/V would make these differ from the reference.
    longer = [p + t[:30] for p, t in zip(PROMPTS, reference)]
    expect = generate(LLM(str(model), **BASE, enable_prefix_caching=False), prompts=longer)
    hits = llm.llm_engine.block_manager.prefix_hits
    assert generate(llm, prompts=longer) == expect
    assert llm.llm_engine.block_manager.prefix_hits > hits
    llm.llm_engine.check_integrity()


def test_max_tokens_never_exceeded(model):
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    expect = generate(LLM(str(model), **BASE), params)
    llm = LLM(str(model), **BASE, speculative_config=ngram(5))
    got = generate(llm, params)
    assert got == expect
    assert all(len(t) == 7 for t in got)


def test_stop_token_truncates_accepted_tokens(model, reference):
    # A token each looping output emits more than once: non-speculative decoding stops at its
    # first occurrence; a verified run that went past it must be cut there too.
    stops = sorted({t for out in reference for t in out[5:] if out.count(t) > 1})[:8]
    params = SamplingParams(temperature=0, max_tokens=48, stop_token_ids=stops)
    expect = generate(LLM(str(model), **BASE), params)
    assert any(len(t) < 48 for t in expect)
    assert generate(LLM(str(model), **BASE, speculative_config=ngram(5)), params) == expect


def test_stop_strings_equal_without_speculation(model, reference):
    llm_ref = LLM(str(model), **BASE)
    tok = llm_ref.get_tokenizer()
    # Stop strings cut from the middle of the looping outputs' text.
    texts = [tok.decode(out[10:]) for out in reference]
    stops = [t[len(t) // 2 : len(t) // 2 + 3] for t in texts if len(t) > 8][:4]
    params = SamplingParams(temperature=0, max_tokens=48, stop=stops, logprobs=1)
    outs_ref = llm_ref.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm = LLM(str(model), **BASE, speculative_config=ngram(5))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in outs_ref]
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        list(o.outputs[0].token_ids) for o in outs_ref
    ]
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)
    # A run cut at the stop keeps the logprobs of the tokens it kept.
    assert all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o in outs)


def test_parallel_samples_greedy_and_seeded(model):
    greedy = SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(model), **BASE, speculative_config=ngram(3))
    assert generate(llm, greedy) == generate(LLM(str(model), **BASE), greedy)
    seeded = SamplingParams(n=2, temperature=0.8, top_k=4, seed=11, max_tokens=24)
    first = generate(llm, seeded)
    again = generate(LLM(str(model), **BASE, speculative_config=ngram(3)), seeded)
    assert first == again  # reproducible: each sample's generator is consumed the same way


def test_structured_outputs_valid_and_equal(model):
    params = SamplingParams(
        temperature=0,
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta gamma"]),
    )
    prompts = PROMPTS[:4]
    expect = generate(LLM(str(model), **BASE), params, prompts)
    llm = LLM(str(model), **BASE, speculative_config=ngram(3))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expect
    assert all(o.outputs[0].text in ("alpha", "beta gamma") for o in outs)


@pytest.mark.parametrize("regex", ["[ab ]{40}", "(cat|dog|fish)( (cat|dog|fish)){12}"])
def test_structured_outputs_verify_proposals_against_the_grammar(model, regex):
    # Few characters allowed: the constrained greedy output repeats itself, so proposals are
    # made, checked against the grammar, masked row by row and accepted.
    params = SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    prompts = PROMPTS[:6]
    ref = LLM(str(model), **BASE).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    llm = LLM(str(model), **BASE, speculative_config=ngram(4))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs)
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0


@pytest.mark.parametrize(
    "extra",
    [
        {"repetition_penalty": 1.05},
        {"frequency_penalty": 0.05, "presence_penalty": 0.05},
        {"min_tokens": 30},
    ],
    ids=["repetition", "frequency_presence", "min_tokens"],
)
def test_history_dependent_sampling_sees_each_rows_history(model, extra):
    # Row j of a verification is processed with the output followed by proposals [0, j), the
    # history decoding without speculation sees there: greedy outputs stay equal.
    params = SamplingParams(temperature=0, max_tokens=40, **extra)
    expect = generate(LLM(str(model), **BASE), params)
    llm = LLM(str(model), **BASE, speculative_config=ngram(3))
    assert generate(llm, params) == expect
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0


def test_logprobs_of_verified_tokens_equal_without_speculation(model):
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[-4:]]
    llm = LLM(str(model), **BASE, speculative_config=ngram(3))
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref = LLM(str(model), **BASE).generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0
    for got, want in zip(outs, ref):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(got.outputs[0].logprobs) == 24
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert list(a) == list(b)  # chosen token first, then the same top-2
            for token in a:
                assert a[token].rank == b[token].rank
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)
        assert got.outputs[0].cumulative_logprob == pytest.approx(
            want.outputs[0].cumulative_logprob, abs=1e-3
        )


@pytest.mark.parametrize("with_stop", [False, True])
def test_delta_outputs_add_up_with_several_tokens_per_step(model, reference, with_stop):
    # Verified runs hand several tokens to one step's output: the DELTA outputs still add up
    # to the CUMULATIVE one (text, tokens, logprobs), and sampling is reproducible by seed.
    llm = LLM(str(model), **BASE, speculative_config=ngram(4))
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    # A stop string from the looping greedy output: likely inside a verified run.
    stops = [tok.decode(reference[-2][8:10])] if with_stop else None

    def run(kind: RequestOutputKind) -> list:
        params = SamplingParams(temperature=0.3, top_k=3, seed=3, n=2, max_tokens=40,
                                logprobs=1, stop=stops, output_kind=kind)  # fmt: skip
        engine.add_request("r", {"prompt_token_ids": PROMPTS[-2]}, params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        return outs

    final = run(RequestOutputKind.CUMULATIVE)[-1]
    deltas = run(RequestOutputKind.DELTA)
    assert engine.spec_decode_stats.num_accepted_tokens > 0
    for index, whole in enumerate(final.outputs):
        parts = [c for d in deltas for c in d.outputs if c.index == index]
        assert "".join(c.text for c in parts) == whole.text
        assert [t for c in parts for t in c.token_ids] == whole.token_ids
        assert [lp for c in parts for lp in c.logprobs] == whole.logprobs
