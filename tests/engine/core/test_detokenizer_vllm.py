"""Incremental detokenization and stop strings against vLLM's ``FastIncrementalDetokenizer``,
on a hand-built Llama-2-style tokenizer (byte fallback, ``▁`` for spaces, the first space
stripped), whose decoded text is not monotonic: a run of byte tokens that stops being valid
UTF-8 decodes as U+FFFD throughout, characters already shown included."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.output_processor import (
    LogprobTexts,
    decode_logprob_tokens,
    logprob_dicts,
    new_sample_state,
    stop_holdback,
    take_tokens,
)
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import check_token_stop
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.worker.step_messages import LogprobsLists, ModelRunnerOutput

WORDS = ["▁", "a", "b", "c", "h", "e", "▁he", "llo"]


def _byte_fallback_bpe() -> Tokenizer:
    """<unk> <s> </s>, the 256 byte tokens, then ``WORDS``; no merges."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({w: 259 + i for i, w in enumerate(WORDS)})
    return Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    backend = _byte_fallback_bpe()
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _byte(b: int) -> int:
    return 3 + b


def _word(w: str) -> int:
    return 259 + WORDS.index(w)


def test_non_monotonic_decode_restarts_the_stream_as_vllm(tok) -> None:
    # "日" (E6 97 A5), a stray continuation byte, then "a": the full decode turns the whole
    # byte run into U+FFFD, which breaks DecodeStream's prefix ("Invalid prefix encountered").
    # vLLM restarts the stream without context and goes on: "日" stays, "a" follows.
    out = [_byte(0xE6), _byte(0x97), _byte(0xA5), _byte(0x89), _word("a"), _word("b")]
    detok = IncrementalDetokenizer(tok, [1, _word("a")])
    for token in out:
        detok.update([token])
    detok.finish()
    assert detok.output_text == "日ab"


def test_stop_string_must_end_after_the_min_tokens_th_token(tok) -> None:
    # vLLM matches, once past min_tokens, only stop strings that end in the text of the tokens
    # after the min_tokens-th: a short stop string wholly in earlier text never matches.
    detok = IncrementalDetokenizer(tok, [1], stop=["b", "zzzz"], min_tokens=2)
    hits = [detok.update([_word(w)]) for w in ("b", "a", "a", "c")]
    assert hits == [False] * 4 and detok.stop_string is None
    assert detok.output_text == "baac"
    # One ending in the new text may start before it.
    detok = IncrementalDetokenizer(tok, [1], stop=["bac"], min_tokens=2)
    hits = [detok.update([_word(w)]) for w in ("b", "a", "c")]
    assert hits == [False, False, True] and detok.output_text == ""


def test_no_holdback_with_include_stop_str_in_output() -> None:
    # vLLM's stop_buffer_length: a match keeps the stop string, so no sent text is ever cut.
    assert stop_holdback(SamplingParams(stop=["abcd"], include_stop_str_in_output=True)) == 0
    assert stop_holdback(SamplingParams(stop=["abcd"])) == 3


@pytest.fixture(scope="module")
def metaspace_tok() -> PreTrainedTokenizerFast:
    """Mistral-style: a Metaspace pre-tokenizer, whose decoder strips the first space."""
    backend = _byte_fallback_bpe()
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [
            decoders.Metaspace(replacement="▁", prepend_scheme="first"),
            decoders.ByteFallback(),
            decoders.Fuse(),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_logprob_text_keeps_the_leading_space_of_a_metaspace_piece(metaspace_tok) -> None:
    # vLLM's convert_ids_list_to_tokens: "▁he" decoded alone is "he" (the decoder strips the
    # first space), and the space its piece stands for is put back: " he", as in the text.
    he, a, space = _word("▁he"), _word("a"), _word("▁")
    assert metaspace_tok.decode([he]) == "he"
    lists = LogprobsLists(token_ids=[[he, a, space]], logprobs=[[-0.1, -2.0, -3.0]], ranks=[1])
    output = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[he]], logprobs=[lists])
    texts = decode_logprob_tokens(metaspace_tok, output)
    [entry] = logprob_dicts(lists, texts, [])
    assert [entry[t].decoded_token for t in (he, a, space)] == [" he", "a", " "]
    # Decoded lazily (a token outside the step's batch) the same.
    assert LogprobTexts(metaspace_tok, {}).text(he, []) == " he"
    # A byte token still reads "" until its character completes.
    e6, x97, xa5 = _byte(0xE6), _byte(0x97), _byte(0xA5)
    assert LogprobTexts(metaspace_tok, {}).text(xa5, [e6, x97]) == "日"


@pytest.mark.parametrize(("eos", "reason"), [(4, 4), (2, None)])
def test_generation_config_eos_other_than_the_tokenizers_is_the_stop_reason(
    tok, eos, reason
) -> None:
    # generation_config.json eos_token_id [2, 4], the tokenizer's EOS 2: vLLM stops on 4 as a
    # stop token (stop_reason 4) and on its tokenizer's EOS with stop_reason None.
    request = Request(
        "r",
        [1, _word("a")],
        SamplingParams(),
        eos_token_ids=frozenset({2, 4}),
        eos_token_id=tok.eos_token_id,
        max_tokens=8,
    )
    sample = new_sample_state(request, tok)
    request.append_output_token_ids([eos])
    request.status = check_token_stop(request, max_model_len=64)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert not take_tokens(sample, 1, None, LogprobTexts(tok, {}))
    assert request.stop_reason == reason
    assert sample.detokenizer.output_text == ""


def test_spaces_between_special_tokens_false_joins_consecutive_added_tokens() -> None:
    # A decoder that joins tokens with spaces (WordPiece): as vLLM's fast detokenizer, an added
    # token right after another is its bare content; one after a word keeps its space.
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    wp = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", additional_special_tokens=["<x>", "<y>"]
    )
    x, y = wp.convert_tokens_to_ids(["<x>", "<y>"])
    out = [1, x, y, 2, y, x, x, 1]

    def text(**kwargs) -> str:
        detok = IncrementalDetokenizer(wp, [1, 2], **kwargs)
        for token in out:
            detok.update([token])
        return detok.output_text

    assert text(skip_special_tokens=False) == " a <x> <y> b <y> <x> <x> a"
    assert (
        text(skip_special_tokens=False, spaces_between_special_tokens=False)
        == " a <x><y> b <y><x><x> a"
    )
    assert text(spaces_between_special_tokens=False) == " a b a"
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert not params.spaces_between_special_tokens


def test_detokenize_false_gives_no_text_and_no_logprob_texts(tok) -> None:
    # vLLM: detokenize=False runs without a tokenizer: text "", decoded_token None; stop
    # strings need text, so they are refused.
    params = SamplingParams(detokenize=False, logprobs=1)
    request = Request("r", [1, _word("a")], params, eos_token_ids=frozenset({2}), max_tokens=8)
    sample = new_sample_state(request, tok)
    he = _word("▁he")
    request.append_output_token_ids([he])
    lists = LogprobsLists(token_ids=[[he, 2]], logprobs=[[-0.1, -2.0]], ranks=[1])
    assert not take_tokens(sample, 1, lists, LogprobTexts(tok, {}))
    assert sample.detokenizer.output_text == ""
    assert [lp.decoded_token for lp in sample.logprobs[0].values()] == [None, None]
    with pytest.raises(InvalidRequestError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["a"])


def test_the_tokenizers_eos_stops_even_where_generation_config_leaves_it_out(tok, tmp_path) -> None:
    # vLLM stops on the tokenizer's EOS and on generation_config's: both, whichever lists what.
    from engine.core.input_processor import eos_token_ids

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [4]}')
    assert eos_token_ids(str(tmp_path), tok) == {2, 4}
    (tmp_path / "generation_config.json").unlink()
    assert eos_token_ids(str(tmp_path), tok) == {2}
