"""A structured output of a reasoning model (``StructuredOutputsParams.reasoning_end_token_id``)
on the real engine with ``builtin:tiny-qwen3-reasoning``: no token is masked until ``</think>``
is sampled, then the grammar constrains the answer from its initial state. ``logit_bias`` on
``</think>`` makes the random-weight model end its reasoning after a few tokens; the schema has
no strings, so the grammar rules ``</think>`` out of the answer whatever its bias."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from engine import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_reasoning_models import REASONING_VOCAB_SIZE, THINK_END_ID, THINK_START_ID
from engine.core.structured_output import StructuredOutputManager

MODEL = "builtin:tiny-qwen3-reasoning"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 99},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
# With this bias the greedy model writes </think> as its 3rd token for PROMPT (and again later
# when unconstrained); measured, and asserted below so that a changed model shows here.
BIAS = {THINK_END_ID: 6.0}
PROMPT = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, num_kv_blocks=128, device="cpu")


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(MODEL))
    return tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def _generate(llm: LLM, prompt: list[int], **params: Any) -> Any:
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**params), use_tqdm=False)
    return out[0].outputs[0]


def test_grammar_starts_after_the_reasoning(llm: LLM, prompt_ids: list[int]) -> None:
    greedy = {"temperature": 0, "max_tokens": 60, "logit_bias": BIAS}
    free = _generate(llm, prompt_ids, **greedy)
    cut = free.token_ids.index(THINK_END_ID) + 1
    assert cut == 3
    spec = StructuredOutputsParams(json=SCHEMA, reasoning_end_token_id=THINK_END_ID)
    constrained = _generate(llm, prompt_ids, **greedy, structured_outputs=spec)
    # Nothing masked before </think>: the same tokens as without a grammar, up to it.
    assert constrained.token_ids[:cut] == free.token_ids[:cut]
    assert free.token_ids[cut:] != constrained.token_ids[cut:]
    # After it, the answer is the schema's, from the grammar's start, and ends the request.
    answer = constrained.text.partition("</think>")[2]
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert constrained.finish_reason == "stop"
    # The same answer as a grammar applied from the first token of a prompt that already holds
    # the reasoning: the grammar started from its initial state.
    again = _generate(
        llm,
        prompt_ids + constrained.token_ids[:cut],
        **greedy,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    assert again.token_ids == constrained.token_ids[cut:]


def test_without_the_end_token_the_output_is_unconstrained(llm: LLM, prompt_ids: list[int]) -> None:
    """A reasoning that never ends (</think> banned) leaves the whole output to the model."""
    params = {"temperature": 0, "max_tokens": 12, "logit_bias": {THINK_END_ID: -100.0}}
    free = _generate(llm, prompt_ids, **params)
    spec = StructuredOutputsParams(json=SCHEMA, reasoning_end_token_id=THINK_END_ID)
    dormant = _generate(llm, prompt_ids, **params, structured_outputs=spec)
    assert dormant.token_ids == free.token_ids
    assert dormant.finish_reason == "length"


def test_dormant_grammar_wakes_in_its_initial_state() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(MODEL))
    manager = StructuredOutputManager(tokenizer, REASONING_VOCAB_SIZE)
    spec = StructuredOutputsParams(json=SCHEMA, reasoning_end_token_id=THINK_END_ID)
    grammar = manager.new_grammar(spec)
    fresh = manager.new_grammar(StructuredOutputsParams(json=SCHEMA))
    assert not grammar.active and fresh.active
    # Tokens the grammar would reject pass while it is dormant, <think> included.
    assert grammar.accept_tokens([THINK_START_ID, 70, 71, THINK_END_ID])
    assert grammar.active and grammar.num_accepted_tokens == 0
    rows = xgr.allocate_token_bitmask(2, REASONING_VOCAB_SIZE)
    grammar.fill_bitmask(rows, 0)
    fresh.fill_bitmask(rows, 1)
    assert torch.equal(rows[0], rows[1])
    # Tokens after </think> in the same step are the grammar's.
    late = manager.new_grammar(spec)
    brace = tokenizer.encode("{", add_special_tokens=False)
    assert late.accept_tokens([70, THINK_END_ID, *brace]) and late.num_accepted_tokens == 1
    assert not manager.new_grammar(spec).accept_tokens([THINK_END_ID, 70])  # "x" is not JSON


def test_reasoning_end_token_id_is_checked(llm: LLM, prompt_ids: list[int]) -> None:
    with pytest.raises(InvalidRequestError, match="reasoning_end_token_id"):
        StructuredOutputsParams(json=SCHEMA, reasoning_end_token_id=-1)
    spec = StructuredOutputsParams(json=SCHEMA, reasoning_end_token_id=REASONING_VOCAB_SIZE)
    with pytest.raises(InvalidRequestError, match=r"in \[0, 1026\)") as err:
        _generate(llm, prompt_ids, max_tokens=4, structured_outputs=spec)
    assert err.value.param == "structured_outputs.reasoning_end_token_id"
