"""``output_processor``'s logprob texts: a token that ends inside a UTF-8 character (a byte of
tiny-llama's byte-level vocabulary) reads as vLLM's ``decoded_token``, "" until the token that
finishes the character, which carries all of it; alternatives finish it their own way."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.builtin.catalog import resolve_model_source
from engine.core.output_processor import LogprobTexts, logprob_dicts
from engine.worker.step_messages import LogprobsLists


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return AutoTokenizer.from_pretrained(resolve_model_source("builtin:tiny-llama"))


def test_a_character_split_over_tokens_is_the_text_of_the_token_that_finishes_it(
    tokenizer: object,
) -> None:
    hi = tokenizer.encode("hi", add_special_tokens=False)
    c7, b7 = tokenizer.encode("Ƿ", add_special_tokens=False)  # C7 B7
    _, b8 = tokenizer.encode("Ǹ", add_special_tokens=False)  # C7 B8
    assert tokenizer.decode([c7]) == tokenizer.decode([b7]) == "\ufffd"
    texts = LogprobTexts(tokenizer, {})
    assert texts.text(c7, hi) == ""
    assert texts.text(b7, [*hi, c7]) == "Ƿ"
    assert texts.text(b8, [*hi, c7]) == "Ǹ"  # an alternative to B7 after the same C7
    assert texts.text(b7, []) == ""  # nothing before it to finish
    assert texts.text(hi[-1], [c7]) == tokenizer.decode(hi[-1:])


def test_logprob_rows_read_each_chosen_token_as_the_next_rows_context(tokenizer: object) -> None:
    c7, b7 = tokenizer.encode("Ƿ", add_special_tokens=False)
    _, b8 = tokenizer.encode("Ǹ", add_special_tokens=False)
    o = tokenizer.encode("o", add_special_tokens=False)[0]
    lists = LogprobsLists([[c7, o], [b7, b8], [o, c7]], [[-1.0, -2.0]] * 3, [1, 1, 1])
    entries = logprob_dicts(lists, LogprobTexts(tokenizer, {}), context=[])
    texts = [{t: lp.decoded_token for t, lp in e.items()} for e in entries]
    assert texts == [{c7: "", o: "o"}, {b7: "Ƿ", b8: "Ǹ"}, {o: "o", c7: ""}]
    chosen = b"".join(e[t].decoded_token.encode() for e, t in zip(entries, (c7, b7, o)))
    assert chosen == tokenizer.decode([c7, b7, o]).encode()
