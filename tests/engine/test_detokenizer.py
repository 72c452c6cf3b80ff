"""Incremental detokenization against the tokenizer's own full decode."""

from __future__ import annotations

import itertools

from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.tiny_models import resolve_model_source

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


def test_trailing_incomplete_character_is_flushed_at_finish() -> None:
    tok = _tokenizer()
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [1])
    detok.update(ids[:-1])
    assert detok.output_text == ""
    detok.finish()
    assert detok.output_text == tok.decode(ids[:-1])


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


def test_special_tokens_are_skipped_by_default() -> None:
    tok = _tokenizer()
    detok = IncrementalDetokenizer(tok, [1])
    detok.update([tok.eos_token_id])
    detok.finish()
    assert detok.output_text == ""
    keep = IncrementalDetokenizer(tok, [1], skip_special_tokens=False)
    keep.update([tok.eos_token_id])
    assert keep.output_text == tok.eos_token
