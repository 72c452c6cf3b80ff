"""Beam search: width 1 is greedy; width 4 on a vocabulary-8 model keeps exactly the beams an
independent brute force over HF transformers' log-probabilities keeps."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source

VOCAB = 8
PROMPT = [3, 1, 4, 1, 5]
LENGTH = 3
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vocab8")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.5,  # peaked distributions: no near-ties among the beams
        bos_token_id=0,
        eos_token_id=7,
        pad_token_id=0,
    )
    torch.manual_seed(5)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def scores(tiny_vocab_model: Path) -> dict[tuple[int, ...], float]:
    """Cumulative logprob of every continuation of length <= LENGTH, from HF forward passes."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_vocab_model, dtype=torch.float32).eval()
    scores: dict[tuple[int, ...], float] = {(): 0.0}
    for length in range(LENGTH):
        prefixes = list(itertools.product(range(VOCAB), repeat=length))
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
        logprobs = logits.float().log_softmax(-1)
        for row, prefix in enumerate(prefixes):
            for token in range(VOCAB):
                scores[(*prefix, token)] = scores[prefix] + logprobs[row, token].item()
    return scores


def _beam_search_on_table(scores: dict[tuple[int, ...], float], width: int) -> list[tuple]:
    beams: list[tuple[int, ...]] = [()]
    for _ in range(LENGTH):
        candidates = [(*b, t) for b in beams for t in range(VOCAB)]
        beams = sorted(candidates, key=scores.__getitem__, reverse=True)[:width]
    return beams


@pytest.fixture(scope="module")
def llm(tiny_vocab_model: Path) -> LLM:
    tokenizer = str(resolve_model_source("builtin:tiny-llama"))
    return LLM(str(tiny_vocab_model), tokenizer=tokenizer, num_kv_blocks=64)


def test_width_4_keeps_the_brute_force_best_beams(llm: LLM, scores: dict) -> None:
    expected = _beam_search_on_table(scores, width=4)
    out = llm.beam_search(
        {"prompt_token_ids": PROMPT}, beam_width=4, max_tokens=LENGTH, ignore_eos=True
    )[0]
    got = [tuple(o.token_ids) for o in out.outputs]
    assert got == expected
    for o in out.outputs:
        assert o.cumulative_logprob == pytest.approx(scores[tuple(o.token_ids)], abs=TOL)
    # On this model the pruned search also finds the 4 best of all 512 sequences.
    everything = [s for s in scores if len(s) == LENGTH]
    assert got == sorted(everything, key=scores.__getitem__, reverse=True)[:4]


def test_width_as_large_as_the_tree_finds_the_global_best(llm: LLM, scores: dict) -> None:
    # Width 8 over a vocabulary of 8 prunes nothing at step 1, so 2-token beams are exhaustive.
    out = llm.beam_search(
        {"prompt_token_ids": PROMPT}, beam_width=8, max_tokens=2, ignore_eos=True
    )[0]
    two = [s for s in scores if len(s) == 2]
    assert [tuple(o.token_ids) for o in out.outputs] == sorted(
        two, key=scores.__getitem__, reverse=True
    )[:8]


def test_width_1_equals_greedy() -> None:
    llm = LLM("builtin:tiny-llama", num_kv_blocks=64)
    prompt = {"prompt_token_ids": list(range(40, 80))}
    greedy = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    beam = llm.beam_search(prompt, beam_width=1, max_tokens=10, ignore_eos=True)[0].outputs
    assert [o.token_ids for o in beam] == [greedy.token_ids]
    llm.llm_engine.check_integrity()


def test_beams_reuse_the_prompt_blocks_through_the_prefix_cache() -> None:
    llm = LLM("builtin:tiny-llama", num_kv_blocks=64)
    engine = llm.llm_engine
    llm.beam_search({"prompt_token_ids": list(range(100, 164))}, beam_width=2, max_tokens=4)
    # Step 1 computes the 64-token prompt; each later beam request finds >= 48 of its tokens
    # (3 full prompt blocks) cached instead of recomputing them.
    queries, hits = engine.block_manager.prefix_queries, engine.block_manager.prefix_hits
    assert hits >= 3 * 2 * 48
    assert hits / queries > 0.7


def test_generate_routes_use_beam_search_params_to_the_driver(llm: LLM) -> None:
    params = SamplingParams(
        use_beam_search=True, temperature=0, beam_width=4, n=2, max_tokens=LENGTH, ignore_eos=True
    )
    via_generate = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    direct = llm.beam_search(
        {"prompt_token_ids": PROMPT}, beam_width=4, max_tokens=LENGTH, ignore_eos=True
    )[0]
    assert [o.token_ids for o in via_generate.outputs] == [o.token_ids for o in direct.outputs[:2]]
