"""``SamplingParams.allowed_token_ids`` (vLLM's) on the real engine: greedy output equals Hugging
Face's ``generate`` restricted to the same tokens (``prefix_allowed_tokens_fn``), token for
token in fp32; a random draw never leaves them; ids outside the vocabulary, or none, are refused
naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.errors import InvalidRequestError

MODEL = "builtin:tiny-llama"
ALLOWED = [5, 17, 42, 99, 300]
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM(MODEL, num_kv_blocks=32, max_model_len=128, device="cpu", dtype="float32")
    yield llm
    llm.llm_engine.shutdown()


def test_greedy_equals_hugging_face_restricted_to_the_same_tokens(llm: LLM) -> None:
    path = resolve_model_source(MODEL)
    ids = AutoTokenizer.from_pretrained(path).encode(PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
            prefix_allowed_tokens_fn=lambda batch, seq: ALLOWED,
        )  # fmt: skip
    expected = out[0, len(ids) :].tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=ALLOWED)
    [got] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert list(got.outputs[0].token_ids) == expected
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [unrestricted] = llm.generate({"prompt_token_ids": ids}, free, use_tqdm=False)
    assert list(unrestricted.outputs[0].token_ids) != expected  # the restriction mattered


def test_a_draw_stays_within_them(llm: LLM) -> None:
    params = SamplingParams(temperature=1.5, max_tokens=32, ignore_eos=True, seed=7,
                            allowed_token_ids=ALLOWED[:2])  # fmt: skip
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    assert set(out.outputs[0].token_ids) == set(ALLOWED[:2])


@pytest.mark.parametrize("allowed", [[], [10**6], [-1]])
def test_bad_ids_are_refused_naming_the_field(llm: LLM, allowed: list[int]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=allowed), use_tqdm=False)
    assert info.value.param == "allowed_token_ids"
