"""Out-of-range sampling parameters and requests above the server's caps are rejected with an
error naming the parameter, and nothing is enqueued; a JSON schema nested too deeply too."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine import LLM, ConfigError, InvalidRequestError, SamplingParams
from engine.sampling_params import StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        # inf would make the logits NaN (every draw the last token id).
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"bad_words": ["ok", " "]}, "bad_words"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"use_beam_search": True, "beam_width": 2}, "temperature"),
        ({"use_beam_search": True, "temperature": 0, "beam_width": 2, "n": 3}, "n"),
        ({"use_beam_search": True, "temperature": 0, "n": 2, "top_k": 5}, "top_k"),
        ({"beam_width": 0}, "beam_width"),
        # Seeds are 64-bit: torch.Generator and the msgpack step message take no more.
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        # A digit to str.isdigit that int() cannot parse; more digits than int() will parse.
        ({"logit_bias": {"²": 1.0}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),
    ],
)
def test_out_of_range_value_names_the_parameter(kwargs, field) -> None:
    with pytest.raises(InvalidRequestError, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field


def test_logit_bias_accepts_json_string_keys() -> None:
    assert SamplingParams(logit_bias={"7": -1}).logit_bias == {7: -1.0}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("builtin:tiny-llama", num_kv_blocks=64, max_model_len=256, max_n=4, max_logprobs=5)


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"n": 5}, "n", "max_n"),
        ({"logprobs": 6}, "logprobs", "max_logprobs"),
        ({"prompt_logprobs": 6}, "prompt_logprobs", "max_logprobs"),
        ({"max_tokens": None, "min_tokens": 250}, "min_tokens", "max_tokens"),
        ({"logit_bias": {10**6: 1.0}}, "logit_bias", "vocabulary"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids", "vocabulary"),
        ({"bad_words_token_ids": [[1, 10**6]]}, "bad_words_token_ids", "must be in"),
        ({"use_beam_search": True, "temperature": 0}, "use_beam_search", "beam_search"),
    ],
)
def test_request_above_a_cap_is_rejected_before_it_is_enqueued(
    llm: LLM, kwargs, field, message
) -> None:
    engine = llm.llm_engine
    with pytest.raises(InvalidRequestError, match=message) as info:
        engine.add_request(
            "capped", {"prompt_token_ids": list(range(10))}, SamplingParams(**kwargs)
        )
    assert info.value.param == field
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.requests and not engine.scheduler.pending_forks
    engine.check_integrity()


def test_64_bit_seeds_run(llm: LLM) -> None:
    for seed in (2**63 - 1, -(2**63)):
        params = SamplingParams(n=2, seed=seed, max_tokens=2, ignore_eos=True)
        out = llm.generate("x", params, use_tqdm=False)[0]
        assert [len(o.token_ids) for o in out.outputs] == [2, 2]


def test_top_k_beyond_the_vocabulary_samples_from_every_token(llm: LLM) -> None:
    # Batched with a top_k request, so the sampler builds a top_k tensor holding both.
    params = {"temperature": 1.0, "seed": 5, "max_tokens": 6, "ignore_eos": True}
    huge, small = SamplingParams(top_k=2**64, **params), SamplingParams(top_k=3, **params)
    outs = llm.generate(["Once", "Twice"], [huge, small], use_tqdm=False)
    unfiltered = llm.generate("Once", SamplingParams(**params), use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == unfiltered.outputs[0].token_ids
    llm.llm_engine.check_integrity()


def test_requests_at_the_caps_run(llm: LLM) -> None:
    params = SamplingParams(n=4, logprobs=5, prompt_logprobs=5, max_tokens=2, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": list(range(10))}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(len(o.logprobs[0]) >= 5 for o in out.outputs)


def test_a_bad_words_spaced_form_is_banned_only_where_it_is_a_word_of_its_own(llm: LLM) -> None:
    """vLLM's rule: the space-prefixed tokenization joins the bare one only when its first token
    differs and it is as long (a longer one would ban a word's pieces mid-text)."""
    tokenizer, inputs = llm.get_tokenizer(), llm.llm_engine.inputs
    word = "antidisestablishment"
    bare = tokenizer.encode(word, add_special_tokens=False)
    spaced = tokenizer.encode(" " + word, add_special_tokens=False)
    assert len(spaced) != len(bare)  # the tiny tokenizer splits the two differently
    assert inputs.bad_word_token_ids(word) == [bare]


def test_a_seed_of_minus_one_is_no_seed_as_in_vllm() -> None:
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2


def test_bad_words_are_tokenized_on_the_head(llm: LLM) -> None:
    engine = llm.llm_engine
    request = engine.add_request(
        "words", "Hello", SamplingParams(bad_words=["world"], max_tokens=1)
    )
    tokenizer = llm.get_tokenizer()
    assert request.sampling_params.bad_words_token_ids == [
        tokenizer.encode("world", add_special_tokens=False),
        tokenizer.encode(" world", add_special_tokens=False),
    ]
    engine.abort_request("words")


def test_banned_words_never_appear_in_greedy_output(llm: LLM) -> None:
    free = llm.generate(
        "The", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    banned = free.token_ids[3]
    out = llm.generate(
        "The",
        SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, bad_words_token_ids=[[banned]]
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids[:3] == free.token_ids[:3]
    assert banned not in out.token_ids


def test_min_tokens_holds_off_stop_token_ids(llm: LLM) -> None:
    free = llm.generate(
        "A", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop = free.token_ids[1]
    out = llm.generate(
        "A",
        SamplingParams(
            temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop], min_tokens=5
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= 6 and stop not in out.token_ids[:5]


def test_include_stop_str_in_output_keeps_the_stop_string(llm: LLM) -> None:
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    free = llm.generate("The", base, use_tqdm=False)[0].outputs[0].text
    stop = free[10:13]
    out = llm.generate(
        "The", base.clone(stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert out.text == free[: free.index(stop) + len(stop)]


@pytest.mark.parametrize(
    ("kwargs", "key"), [({"max_logprobs": -1}, "max_logprobs"), ({"max_n": 0}, "max_n")]
)
def test_bad_caps_name_the_engine_argument(kwargs, key) -> None:
    with pytest.raises(ConfigError, match=key):
        LLM("builtin:tiny-llama", **kwargs)


def _schema_nested(levels: int) -> dict[str, Any]:
    """An array schema whose objects nest ``levels`` deep."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_json_schema_nests_at_most_64_levels_as_in_vllm() -> None:
    """Deeper ones once raised RecursionError in the schema check (and took the engine down)."""
    assert StructuredOutputsParams(json=_schema_nested(64)).json is not None
    too_deep = [
        _schema_nested(65),
        _schema_nested(1000),
        json.dumps(_schema_nested(65)),
        "[" * 5000,
    ]
    for schema in too_deep:
        with pytest.raises(InvalidRequestError, match="nested too deeply") as info:
            StructuredOutputsParams(json=schema)
        assert info.value.param == "structured_outputs.json"
