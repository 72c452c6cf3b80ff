"""Incremental detokenization against the tokenizer's own full decode."""

from __future__ import annotations

import itertools

from transformers import AutoTokenizer

from engine.builtin.catalog import resolve_model_source
from engine.core.detokenizer import IncrementalDetokenizer

TEXT = "naïve café, Ελληνικά, русский, 日本語 🙂 end"


def _tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_source("builtin:tiny-llama"))


def test_token_by_token_text_equals_full_decode_across_multibyte_splits() -> None:
    tok = _tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "text must split a character across tokens"
    prompt = tok.encode("Hello")
    detok = IncrementalDetokenizer(tok, prompt)
    seen = []
    for token in ids:
        detok.update([token])
        seen.append(detok.output_text)
        assert "\ufffd" not in detok.output_text, "a partial character was emitted"
    detok.finish()
    assert detok.output_text == tok.decode(ids) == TEXT
    assert all(a == b[: len(a)] for a, b in itertools.pairwise(seen)), "text only ever grows"


def test_trailing_incomplete_character_is_dropped_at_finish() -> None:
    # As vLLM: the bytes of an unfinished last character are no text (not U+FFFD).
    tok = _tokenizer()
    ids = tok.encode("ok🙂", add_special_tokens=False)
    assert len(tok.encode("🙂", add_special_tokens=False)) > 1
    detok = IncrementalDetokenizer(tok, [1])
    detok.update(ids[:-1])
    assert detok.output_text == "ok"
    detok.finish()
    assert detok.output_text == "ok"


def test_stop_string_spanning_two_updates_is_found_and_cut() -> None:
    tok = _tokenizer()
    ids = tok.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], stop=["o thr"])
    hit = False
    for token in ids:
        hit = detok.update([token])
        if hit:
            break
    assert hit and detok.stop_string == "o thr"
    assert detok.output_text == "one tw"


def test_of_stop_strings_completed_by_one_update_the_first_to_end_wins() -> None:
    """As if the text came one character at a time (vLLM's rule): the stop string that ends
    first, the first listed of two that end together, wherever each starts."""
    tok = _tokenizer()
    ids = tok.encode(" too them hundred more", add_special_tokens=False)
    cases = [
        (["m hundred", "hun"], False, " too them ", "hun"),
        (["m hundred", "hun"], True, " too them hun", "hun"),
        (["them", "too them"], False, " too ", "them"),
        (["too them", "them"], False, " ", "too them"),
    ]
    for stop, include, text, reason in cases:
        detok = IncrementalDetokenizer(tok, [1], stop=stop, include_stop_str_in_output=include)
        assert detok.update(ids)  # every token in one update: all matches at once
        assert (detok.output_text, detok.stop_string) == (text, reason), stop


def test_special_tokens_are_skipped_by_default() -> None:
    tok = _tokenizer()
    detok = IncrementalDetokenizer(tok, [1])
    detok.update([tok.eos_token_id])
    detok.finish()
    assert detok.output_text == ""
    keep = IncrementalDetokenizer(tok, [1], skip_special_tokens=False)
    keep.update([tok.eos_token_id])
    assert keep.output_text == tok.eos_token


def test_prompt_ending_inside_a_character_gives_only_the_text_beyond_the_prompt() -> None:
    """A prompt cut inside a character: the output is the full decode's text beyond the
    prompt's (the completed character is the prompt's, as in vLLM), never the prompt again."""
    tok = _tokenizer()
    ids = tok.encode("Hi 日本 🙂🙂 ok", add_special_tokens=False)
    cuts = [c for c in range(1, len(ids)) if tok.decode(ids[:c]).endswith("\ufffd")]
    assert len(cuts) >= 4, "the text must split characters across tokens"
    for cut in range(len(ids)):
        prompt, out = ids[:cut], ids[cut:]
        detok = IncrementalDetokenizer(tok, prompt)
        seen = []
        for token in out:
            detok.update([token])
            seen.append(detok.output_text)
        detok.finish()
        expected = tok.decode(ids)[len(tok.decode(prompt)) :]
        assert detok.output_text == expected, f"prompt cut after {cut} tokens"
        assert all(a == b[: len(a)] for a, b in itertools.pairwise(seen))


def test_prompt_ending_inside_a_character_with_several_tokens_per_update() -> None:
    tok = _tokenizer()
    ids = tok.encode("日本語", add_special_tokens=False)
    cut = next(c for c in range(1, len(ids)) if tok.decode(ids[:c]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, ids[:cut])
    detok.update(ids[cut:])
    assert detok.output_text == tok.decode(ids)[len(tok.decode(ids[:cut])) :]
