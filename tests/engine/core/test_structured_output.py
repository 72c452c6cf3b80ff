"""Structured outputs on the real engine with the tiny random-weight Llama: whatever the model
prefers, the grammar alone guarantees the output (so every schema here is bounded: strings
with maxLength, arrays with maxItems, enums, integer ranges, closed objects)."""

from __future__ import annotations

import asyncio
import enum
import json
import random
import re
import threading
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from pydantic import BaseModel, Field

from engine import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from engine.client.async_llm_engine import AsyncLLMEngine
from engine.core import structured_output
from engine.core.request import RequestStatus
from engine.core.structured_output import apply_grammar_bitmask, unpack_bitmask
from engine.worker.step_messages import ExecuteModelRequest, NewRequestData, decode_request, encode

MODEL = "builtin:tiny-llama"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "kind": {"enum": ["home", "work"]},
            },
            "required": ["zip", "kind"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, num_kv_blocks=256)


_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "people",
    "read",
    "books",
]


def _prompt(seed: int, num_words: int) -> str:
    """A prompt of ASCII words (the schema's documents are what is checked, not the prompt)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def _json_params(seed: int | None = None, **kwargs: Any) -> SamplingParams:
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=300, structured_outputs=so, **kwargs
    )


def _parse(text: str) -> Any:
    # Strict: no raw control characters in strings, maxLength ones included.
    return json.loads(text)


def _assert_valid(text: str) -> None:
    jsonschema.validate(_parse(text), SCHEMA)


def test_json_schema_output_is_valid_on_20_seeds(llm: LLM) -> None:
    params = [_json_params(seed=i) for i in range(20)]
    outs = llm.generate(["Describe a person:"] * 20, params, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        _assert_valid(completion.text)
    assert len({o.outputs[0].text for o in outs}) > 10, "seeds should give different documents"


def test_json_schema_given_as_text_is_the_same_constraint(llm: LLM) -> None:
    as_text = StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=300, structured_outputs=as_text)
    text = llm.generate("x", params, use_tqdm=False)[0].outputs[0].text
    assert text == llm.generate("x", _json_params(seed=7), use_tqdm=False)[0].outputs[0].text


def test_complete_grammar_stops_even_with_ignore_eos(llm: LLM) -> None:
    out = llm.generate("x", _json_params(seed=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    _assert_valid(out.text)


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutputsParams(json={"type": "object", "properties": {"ok": {"type": "boolean"}},
                                      "required": ["ok"], "additionalProperties": False},
                                disable_any_whitespace=True),
        StructuredOutputsParams(choice=["yes", "no"]),
    ],
    ids=["json", "choice"],
)  # fmt: skip
def test_min_tokens_past_the_document_end_it_with_the_document(
    llm: LLM, so: StructuredOutputsParams
) -> None:
    """The document is complete before ``min_tokens``: the sampler bans the stop token, the
    grammar allows nothing else, so the request ends there (no token sampled from nothing)."""
    params = [
        SamplingParams(temperature=t, seed=i, min_tokens=20, max_tokens=50, structured_outputs=so)
        for i, t in enumerate([0, 1, 1, 1])
    ]
    for out in llm.generate(["Answer:"] * len(params), params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop"
        assert len(completion.token_ids) < 20
        assert llm.get_tokenizer().decode(completion.token_ids) == completion.text
        if so.choice:
            assert completion.text in so.choice
        else:
            assert set(json.loads(completion.text)) == {"ok"}


def test_special_tokens_are_never_their_literal_text_in_a_grammar(llm: LLM) -> None:
    """``<s>``, ``</s>`` and ``<pad>`` are spelled with ordinary tokens, never matched by the
    special token itself (whose text the output then drops), however the model favours it;
    where the text keeps special tokens, a grammar may match one."""
    tokenizer = llm.get_tokenizer()
    special = tokenizer.all_special_ids
    choices = ["<s>", "</s>", "<pad>"]
    cases = [
        StructuredOutputsParams(choice=choices),
        StructuredOutputsParams(regex=r"[a-z<>/]{6,8}"),
        StructuredOutputsParams(json={"type": "string", "minLength": 3, "maxLength": 3}),
    ]
    for so in cases:
        params = [
            SamplingParams(seed=i, max_tokens=20, structured_outputs=so,
                           logit_bias={t: 50.0 for t in special})
            for i in range(6)
        ]  # fmt: skip
        for out in llm.generate(["x"] * len(params), params, use_tqdm=False):
            completion = out.outputs[0]
            assert completion.finish_reason == "stop"
            body = completion.token_ids[:-1]  # the last one ends the grammar
            assert not set(body) & set(special), (so, completion.token_ids)
            if so.choice:
                assert completion.text in choices
            elif so.regex:
                assert re.fullmatch(so.regex, completion.text), completion.text
            else:
                assert len(json.loads(completion.text)) == 3
    # Text that keeps special tokens (a harmony transcript's reader needs them) may spell them
    # with the token itself; the stop token still only ends the document.
    params = SamplingParams(seed=0, max_tokens=20, skip_special_tokens=False,
                            structured_outputs=cases[0], logit_bias={1: 50.0})  # fmt: skip
    completion = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids[0] == 1 and completion.text == "<s>"


def test_regex_output_fullmatches(llm: LLM) -> None:
    pattern = r"\d{3}-[a-z]{2,4}"
    so = StructuredOutputsParams(regex=pattern)
    params = [SamplingParams(seed=i, max_tokens=50, structured_outputs=so) for i in range(8)]
    for out in llm.generate(["Code:"] * 8, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text


def test_choice_output_is_one_of_the_choices(llm: LLM) -> None:
    choices = ["yes", "no", 'say "maybe"', "back\\slash", "two\nlines"]
    so = StructuredOutputsParams(choice=choices)
    params = [SamplingParams(seed=i, max_tokens=20, structured_outputs=so) for i in range(12)]
    for out in llm.generate(["Answer:"] * 12, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text in choices


def test_a_choice_with_control_characters_compiles_to_exactly_itself() -> None:
    """A control character before a hex digit stays itself (xgrammar's ``\\x`` would read
    every hex digit after it: ``a\\x01b`` is ``a\\x1b``)."""
    from xgrammar.testing import _is_grammar_accept_string

    choices = ["a\x01b", "\x0cF", "x\x021", "tab\there"]
    so = StructuredOutputsParams(choice=choices)
    grammar = xgr.Grammar.from_ebnf(structured_output._spec_text(so))
    for choice in choices:
        assert _is_grammar_accept_string(grammar, choice), choice
    for other in ["a\x1b", "\xcf", "x!"]:
        assert not _is_grammar_accept_string(grammar, other), other


def test_lark_grammar_output_matches(llm: LLM) -> None:
    """A grammar with no ``::=`` rule (comments aside) is Lark, as in vLLM."""
    grammar = (
        "// an answer (in EBNF it would read: root ::= ...)\n"
        "start: ANSWER\n"
        'ANSWER: "yes" | "no"  // either word\n'
    )
    so = StructuredOutputsParams(grammar=grammar)
    params = [SamplingParams(seed=i, max_tokens=20, structured_outputs=so) for i in range(6)]
    for out in llm.generate(["Answer:"] * 6, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text in ("yes", "no")


def test_ebnf_grammar_output_matches(llm: LLM) -> None:
    grammar = 'root ::= item ("," item){0,3}\nitem ::= [a-z]{1,5} | [0-9]{1,3}'
    so = StructuredOutputsParams(grammar=grammar)
    params = [SamplingParams(seed=i, max_tokens=60, structured_outputs=so) for i in range(8)]
    for out in llm.generate(["List:"] * 8, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(
            r"([a-z]{1,5}|[0-9]{1,3})(,([a-z]{1,5}|[0-9]{1,3})){0,3}", out.outputs[0].text
        )


def test_json_object_output_that_finishes_is_a_json_object(llm: LLM) -> None:
    # An unbounded grammar: a random-weight model may wander until max_tokens, so only the
    # outputs the grammar completed are checked (they must all parse to an object).
    so = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    params = [SamplingParams(seed=i, max_tokens=200, structured_outputs=so) for i in range(8)]
    outs = [o.outputs[0] for o in llm.generate(["JSON:"] * 8, params, use_tqdm=False)]
    for out in outs:
        assert out.finish_reason in ("stop", "length")
        assert out.text.startswith("{")
        if out.finish_reason == "stop":
            assert isinstance(_parse(out.text), dict)


def test_free_requests_in_a_mixed_batch_match_running_alone(llm: LLM) -> None:
    free = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) for _ in range(3)]
    free_prompts = [_prompt(i, 10 + 7 * i) for i in range(3)]
    alone = llm.generate(free_prompts, free, use_tqdm=False)
    constrained = [_json_params(seed=i) for i in range(3)]
    mixed = llm.generate(
        [p for pair in zip(free_prompts, ["a", "b", "c"]) for p in pair],
        [p for pair in zip(free, constrained) for p in pair],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == [o.outputs[0].token_ids for o in alone]
    for out in mixed[1::2]:
        _assert_valid(out.outputs[0].text)


def test_each_of_n_samples_is_valid(llm: LLM) -> None:
    out = llm.generate("People:", _json_params(seed=11, n=2), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        _assert_valid(completion.text)
    assert out.outputs[0].text != out.outputs[1].text


def test_logprobs_reflect_the_mask(llm: LLM) -> None:
    so = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=5, structured_outputs=so)
    completion = llm.generate("Answer:", params, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    allowed = {tokenizer.encode(c, add_special_tokens=False)[0] for c in ("yes", "no", "y", "n")}
    first = completion.logprobs[0]
    finite = {t for t, lp in first.items() if lp.logprob > float("-inf")}
    assert finite <= allowed
    assert sum(np.exp(lp.logprob) for lp in first.values() if lp.logprob > float("-inf")) > 0.99


@pytest.mark.parametrize(
    "engine_args",
    [
        {"preemption_mode": "recompute"},
        {"preemption_mode": "swap", "swap_space": 0.05},
    ],
    ids=["recompute", "swap"],
)
def test_output_stays_valid_across_preemption(engine_args: dict[str, Any]) -> None:
    llm = LLM(MODEL, num_kv_blocks=40, **engine_args)
    prompts = [_prompt(100 + i, 60) for i in range(8)]
    outs = llm.generate(prompts, [_json_params(seed=i) for i in range(8)], use_tqdm=False)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions > 0, "the setting did not force preemption"
    if engine_args["preemption_mode"] == "swap":
        assert scheduler.num_swap_outs > 0, "preemption fell back to recompute"
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        _assert_valid(out.outputs[0].text)
    assert llm.llm_engine.request_state_sizes()["grammar_matchers"] == 0


def test_matchers_are_dropped_on_finish_and_abort(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.structured_output.compile(_json_params().structured_outputs)  # matchers at once
    engine.add_request("keep", "a", _json_params(seed=1, n=2))
    engine.add_request("drop", "b", _json_params(seed=2))
    assert engine.request_state_sizes()["grammar_matchers"] == 3
    engine.step()
    engine.abort_request("drop")
    assert engine.request_state_sizes()["grammar_matchers"] == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.request_state_sizes()["grammar_matchers"] == 0


@pytest.fixture
def compile_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Grammar compiles wait for the returned event (set at the end of the test)."""
    gate = threading.Event()
    compile_now = structured_output._compile

    def gated(*args: Any) -> Any:
        gate.wait(120)
        return compile_now(*args)

    monkeypatch.setattr(structured_output, "_compile", gated)
    yield gate
    gate.set()


def _run_all(engine: Any) -> dict[str, Any]:
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    return finished


def test_a_compiling_grammar_holds_only_its_own_request(
    llm: LLM, compile_gate: threading.Event
) -> None:
    """A grammar compiles on a thread of its own (a large schema takes seconds): its request
    waits (WAITING_FOR_FSM), the others run to their end meanwhile, and then it runs
    constrained."""
    engine = llm.llm_engine
    spec = StructuredOutputsParams(regex="(xy){3}z")
    engine.add_request("held", "a", SamplingParams(temperature=0, structured_outputs=spec))
    engine.add_request("free", "b", SamplingParams(temperature=0, max_tokens=6))
    finished = {}
    while "free" not in finished:
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(finished["free"].outputs[0].token_ids) == 6
    assert engine.scheduler.requests["held"].status is RequestStatus.WAITING_FOR_FSM
    assert engine.scheduler.waiting_load()[0] == 1  # counted as queued by admission control
    compile_gate.set()
    finished = _run_all(engine)
    assert finished["held"].outputs[0].text == "xyxyxyz"
    assert engine.get_kv_cache_stats().used == 0


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(
    llm: LLM, compile_gate: threading.Event
) -> None:
    engine = llm.llm_engine
    spec = StructuredOutputsParams(regex="(xy){4}z")
    engine.add_request("gone", "a", SamplingParams(temperature=0, n=2, structured_outputs=spec))
    engine.step()
    (final,) = engine.abort_request("gone")
    assert [c.finish_reason for c in final.outputs] == ["abort", "abort"]
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.waiting_load() == (0, 0)
    assert engine.request_state_sizes()["grammar_matchers"] == 0
    compile_gate.set()
    assert engine.step() == []  # the compile's end finds nothing to admit


def test_a_grammar_whose_compile_fails_ends_its_request_only(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spec that parses but does not compile (an xgrammar error) ends its own request with
    "abort"; the others are untouched, and the failure is not cached."""

    def fails(*args: Any) -> Any:
        raise InvalidRequestError("cannot be compiled: out of memory", param="x")

    monkeypatch.setattr(structured_output, "_compile", fails)
    engine = llm.llm_engine
    spec = StructuredOutputsParams(regex="(xy){5}z")
    engine.add_request("bad", "a", SamplingParams(temperature=0, structured_outputs=spec))
    engine.add_request("good", "b", SamplingParams(temperature=0, max_tokens=4))
    finished = _run_all(engine)
    assert finished["bad"].outputs[0].finish_reason == "abort"
    assert finished["good"].outputs[0].finish_reason == "length"
    monkeypatch.undo()
    assert isinstance(engine.structured_output.compile(spec), xgr.CompiledGrammar)


def test_async_engine_passes_structured_outputs_through() -> None:
    engine = AsyncLLMEngine.from_engine_args(model=MODEL, num_kv_blocks=64)
    try:

        async def run() -> str:
            items = [item async for item in engine.generate("Person:", _json_params(seed=5))]
            return items[-1].output.outputs[0].text

        _assert_valid(asyncio.run(run()))
    finally:
        engine.shutdown()


# ---- invalid requests --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("structured_outputs", "field"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "json"),
        ({"regex": "a(b"}, "regex"),
        ({"grammar": 'root ::= undefined_rule "x"'}, "grammar"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
    ],
)
def test_uncompilable_spec_is_rejected_naming_the_field(
    llm: LLM, structured_outputs: dict[str, Any], field: str
) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**structured_outputs))
    with pytest.raises(InvalidRequestError) as err:
        llm.llm_engine.add_request("bad", "x", params)
    assert err.value.param == f"structured_outputs.{field}"
    assert "[" not in err.value.reason.split(":")[0], "xgrammar's log prefix should be cut"
    assert not llm.llm_engine.has_unfinished_requests()


_INT = {"type": "integer", "minimum": 0, "maximum": 9}


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        (False, "the schema false matches no document"),
        ({"type": "string", "maxLength": -1}, "at /maxLength: is not a valid JSON Schema"),
        ({"anyOf": []}, "at /anyOf: is not a valid JSON Schema"),
        ({**_INT, "not": {"const": 3}}, "'not' is not enforced"),
        ({**_INT, "if": {"minimum": 5}, "then": {"maximum": 6}}, "'if' is not enforced"),
        ({"type": "array", "items": _INT, "contains": {"const": 7}}, "'contains' is not enforced"),
        ({"type": "array", "items": _INT, "uniqueItems": True}, "'uniqueItems': true is not"),
        ({"type": "object", "properties": {"a": _INT}, "patternProperties": {"^b": {}}},
         "'patternProperties' beside 'properties' is not enforced"),
        ({"type": "object", "properties": {"a": _INT}, "propertyNames": {"pattern": "^[a-z]+$"}},
         "'propertyNames' beside 'properties' is not enforced"),
        ({"$schema": "http://json-schema.org/draft-03/schema#", "type": "object",
          "properties": {"a": {"type": "integer", "required": True}}},
         "at /$schema: a draft-03 schema is not enforced"),
        ({"allOf": [_INT, {"type": "integer", "maximum": 5}]}, "'allOf' of more than one"),
        ({"type": "number", "multipleOf": 0.5}, "'multipleOf' is enforced only as a whole"),
        ({"type": "integer", "multipleOf": 2.5}, "'multipleOf' is enforced only as a whole"),
        ({"type": "string", "pattern": "^a+$", "minLength": 3}, "'minLength' / 'maxLength' with"),
        ({"type": "object", "required": ["a"]}, "'required' names 'a', which 'properties'"),
        ({"oneOf": [_INT, {"type": "integer", "minimum": 5}]}, "'oneOf' branches that may overlap"),
        (
            {"type": "object", "properties": {"a": {"type": "object", "properties": {
                "b": {"type": "array", "items": _INT, "uniqueItems": True}}}}},
            "at /properties/a/properties/b: 'uniqueItems'",
        ),
        (
            {"type": "object", "properties": {"t": {"type": "string", "format": "date",
                                                    "maxLength": 3}}},
            "at /properties/t: 'minLength' / 'maxLength' with 'pattern' or 'format'",
        ),
        # An assertion beside the keyword xgrammar compiles the node from alone.
        ({"$ref": "#/$defs/a", "maxLength": 2, "$defs": {"a": {"type": "string"}}},
         "'maxLength' beside '$ref' is not enforced"),
        (
            {"type": "object", "properties": {"x": {"$ref": "#/$defs/a", "minimum": 5}},
             "required": ["x"], "$defs": {"a": {"type": "integer"}}},
            "at /properties/x: 'minimum' beside '$ref'",
        ),
        ({"type": "integer", "minimum": 0, "allOf": [{"maximum": 5}]}, "beside 'allOf'"),
        (
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
             "allOf": [{"type": "object", "properties": {"b": {"type": "string"}},
                        "required": ["b"]}]},
            "beside 'allOf'",
        ),
        ({"type": "integer", "minimum": 0, "anyOf": [{"maximum": 5}, {"minimum": 100}]},
         "beside 'anyOf'"),
        ({"type": "string", "anyOf": [{"type": "integer"}, {"type": "string"}]},
         "'type' beside 'anyOf'"),
        ({"type": "string", "maxLength": 2, "oneOf": [{"type": "string"}, {"type": "integer"}]},
         "beside 'oneOf'"),
        ({"type": "string", "enum": ["a", 1]}, "'type' beside 'enum'"),
        ({"enum": ["a", "abc"], "maxLength": 2}, "'maxLength' beside 'enum'"),
        ({"type": "integer", "enum": [1, 10], "maximum": 5}, "'maximum' beside 'enum'"),
        ({"type": "integer", "const": "x"}, "'type' beside 'const'"),
        ({"const": "abc", "pattern": "^z"}, "'pattern' beside 'const'"),
        ({"const": 1, "enum": [2]}, "'enum' beside 'const'"),
        # A local $ref's target is checked wherever it is.
        (
            {"components": {"schemas": {"X": {"type": "array", "items": _INT,
                                              "uniqueItems": True, "maxItems": 3}}},
             "$ref": "#/components/schemas/X"},
            "at /components/schemas/X: 'uniqueItems': true is not",
        ),
        (
            {"x-defs": {"N": {**_INT, "not": {"const": 3}}}, "type": "object",
             "properties": {"n": {"$ref": "#/x-defs/N"}}, "required": ["n"],
             "additionalProperties": False},
            "at /x-defs/N: 'not' is not enforced",
        ),
        ({"x": {"oneOf": [_INT, {"type": "integer", "minimum": 3}]}, "$ref": "#/x"},
         "at /x: 'oneOf' branches that may overlap"),
        ({"x y": {"type": "array", "uniqueItems": True}, "$ref": "#/x%20y"},
         "at /x y: 'uniqueItems'"),
        # Only local JSON-pointer references.
        ({"$ref": "#foo", "$defs": {"a": {"$anchor": "foo", "type": "integer"}}},
         "'$ref' '#foo' is not enforced by the grammar (only local JSON-pointer references"),
        ({"$ref": "urn:x:int", "$defs": {"a": {"$id": "urn:x:int", "type": "integer"}}},
         "'$ref' 'urn:x:int' is not enforced"),
        (
            {"type": "object", "properties": {"a": {"$ref": "https://example.com/x.json"}},
             "required": ["a"]},
            "at /properties/a: '$ref' 'https://example.com/x.json' is not enforced",
        ),
        (
            {"$defs": {"i": {"type": "string"},
                       "r": {"$id": "urn:r", "type": "object",
                             "properties": {"v": {"$ref": "#/$defs/i"}}, "required": ["v"],
                             "$defs": {"i": {"type": "integer"}}}},
             "$ref": "#/$defs/r"},
            "at /$defs/r/properties/v: '$ref' '#/$defs/i' is inside the schema with an '$id' "
            "at /$defs/r",
        ),
        ({"$dynamicRef": "#meta"}, "'$dynamicRef' is not enforced"),
        ({"$recursiveRef": "#"}, "'$recursiveRef' is not enforced"),
        ({"$schema": 5, "type": "integer"}, "at /$schema: is not a valid JSON Schema"),
        # A literal the grammar would write unescaped inside the JSON string.
        (
            {"type": "object", "properties": {"s": {"type": "string",
                                                    "pattern": '^say "hi"$'}},
             "required": ["s"]},
            "at /properties/s: 'pattern' matches '\"' outside a character class",
        ),
        ({"type": "string", "pattern": r"^a\\b$"}, "'pattern' matches"),
        ({"type": "string", "pattern": r"^\\q$"}, "'pattern' matches"),
        ({"type": "string", "pattern": r"^a\nb$"}, "'pattern' matches"),
        ({"type": "string", "pattern": "^a\tb$"}, "'pattern' matches"),
        ({"type": "string", "pattern": r"^a\x22$"}, "'pattern' matches"),
        ({"type": "string", "pattern": r"^a\u0022$"}, "'pattern' matches"),
        ({"type": "string", "pattern": r'^a\"$'}, "'pattern' matches"),
        (
            {"type": "object", "propertyNames": {"pattern": '^k"$'},
             "additionalProperties": {"type": "integer"}},
            "at /propertyNames: 'pattern' matches",
        ),
        ({"type": "object", "patternProperties": {'^k"$': {"type": "integer"}}},
         "'patternProperties' name"),
    ],
)  # fmt: skip
def test_a_schema_the_grammar_would_loosen_is_refused_naming_the_keyword(
    llm: LLM, schema: Any, reason: str
) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    with pytest.raises(InvalidRequestError) as err:
        llm.llm_engine.add_request("loose", "x", params)
    assert err.value.param == "structured_outputs.json"
    assert reason in err.value.reason
    assert not llm.llm_engine.has_unfinished_requests()


def test_exclusive_one_of_single_all_of_and_integer_multiple_of_are_enforced(llm: LLM) -> None:
    """What the checks let through is enforced exactly: every finished document validates."""
    pet = {
        "oneOf": [
            {"$ref": "#/$defs/cat"},
            {"type": "object", "properties": {"kind": {"enum": ["dog", "wolf"]},
                                              "bark": {"type": "boolean"}},
             "required": ["kind", "bark"], "additionalProperties": False},
        ],
    }  # fmt: skip
    schema = {
        "type": "object",
        "properties": {
            "pet": pet,
            "id": {"oneOf": [{"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 99},
                             {"type": "string", "maxLength": 4}]},
            "n": {"allOf": [{"type": "integer", "minimum": 1, "maximum": 5}]},
        },
        "required": ["pet", "id", "n"],
        "additionalProperties": False,
        "$defs": {"cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": _INT},
                          "required": ["kind", "lives"], "additionalProperties": False}},
    }  # fmt: skip
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = [SamplingParams(seed=i, max_tokens=200, structured_outputs=so) for i in range(12)]
    finished = 0
    for out in llm.generate(["Pet:"] * len(params), params, use_tqdm=False):
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
            finished += 1
    assert finished >= 6


def _matches(compiled: xgr.CompiledGrammar, document: str) -> bool:
    """Whether the grammar accepts the whole of ``document`` (not just as a prefix)."""
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(document) and matcher.is_completed()


class _Colour(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


class _Address(BaseModel):
    """A postal address."""

    zip: str = Field(pattern=r"^[0-9]{5}$")
    city: str | None = Field(default=None, max_length=20)


class _Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class _Dog(BaseModel):
    kind: Literal["dog"]
    bark: bool


class _Person(BaseModel):
    name: str = Field(max_length=8, description="full name")
    age: int | None = Field(default=None, ge=0, le=120)
    colour: _Colour = _Colour.RED
    home: _Address = Field(description="where they live")
    work: _Address | None = Field(default=None, description="office")
    pet: Annotated[_Cat | _Dog, Field(discriminator="kind")]
    mode: Literal["a", "b"] = "a"


def test_a_pydantic_models_schema_is_accepted_and_enforced(llm: LLM) -> None:
    """Pydantic writes annotations beside ``$ref`` and ``anyOf`` (description, default, title),
    ``type`` beside ``enum`` / ``const`` and a discriminator beside ``oneOf``: none is
    refused, and the grammar holds documents to the model."""
    schema = _Person.model_json_schema()
    assert set(schema["properties"]["home"]) == {"$ref", "description"}
    assert {"anyOf", "default", "description"} <= set(schema["properties"]["work"])
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    compiled = llm.llm_engine.structured_output.compile(so)
    person = _Person(name="Ann", age=30, home=_Address(zip="12345"),
                     pet=_Cat(kind="cat", lives=3))  # fmt: skip
    assert _matches(compiled, person.model_dump_json())
    too_old = person.model_copy(update={"age": 121})
    assert not _matches(compiled, too_old.model_dump_json())
    dog_with_lives = person.model_dump_json().replace('"kind":"cat"', '"kind":"dog"')
    assert not _matches(compiled, dog_with_lives)


@pytest.mark.parametrize(
    ("schema", "accepted", "refused"),
    [
        ({"type": "integer", "anyOf": [{"type": "integer", "maximum": 0},
                                       {"type": "integer", "minimum": 10}]},
         ["-1", "10"], ["5", '"a"']),
        ({"type": ["number", "null"], "oneOf": [{"type": "integer"}, {"type": "null"}]},
         ["1", "null"], ["1.5"]),
        ({"type": "string", "enum": ["a", "b"]}, ['"a"'], ['"c"']),
        ({"type": "number", "const": 1}, ["1"], ["2"]),
        ({"$ref": "#/$defs/a", "type": "integer", "description": "d", "x-note": {"pattern": 1},
          "$defs": {"a": {"type": "integer", "minimum": 3}}}, ["3"], ["2"]),
        ({"$schema": "http://json-schema.org/draft-07/schema#", "$id": "urn:root",
          "$ref": "#/definitions/a",
          "definitions": {"a": {"$id": "#a", "type": "integer", "minimum": 3}}}, ["3"], ["2"]),
        ({"type": "string", "pattern": r"^[a-z\"]\d\.\w$"}, ['"a1.b"'], ['"a1-b"']),
    ],
)  # fmt: skip
def test_what_the_grammar_enforces_beside_ref_any_of_and_enum_is_accepted(
    llm: LLM, schema: dict[str, Any], accepted: list[str], refused: list[str]
) -> None:
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    compiled = llm.llm_engine.structured_output.compile(so)
    assert all(_matches(compiled, document) for document in accepted)
    assert not any(_matches(compiled, document) for document in refused)


def _outside_strings(text: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def test_disable_any_whitespace_writes_no_space_after_commas_and_colons(llm: LLM) -> None:
    """As in vLLM: ``{"a":1,"b":[1,2]}``, never ``{"a": 1, "b": [1, 2]}``."""
    manager = llm.llm_engine.structured_output
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
              "b": {"type": "array", "items": {"type": "integer"}}}}  # fmt: skip
    for so in (StructuredOutputsParams(json=schema, disable_any_whitespace=True),
               StructuredOutputsParams(json_object=True, disable_any_whitespace=True)):  # fmt: skip
        compiled = manager.compile(so)
        assert _matches(compiled, '{"a":1,"b":[1,2]}')
        assert not _matches(compiled, '{"a": 1, "b": [1, 2]}')
        assert not _matches(compiled, '{"a":1, "b":[1,2]}')
    outs = llm.generate(["x"] * 4, [_json_params(seed=i) for i in range(4)], use_tqdm=False)
    for out in outs:
        assert not re.search(r"\s", _outside_strings(out.outputs[0].text)), out.outputs[0].text


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({}, "structured_outputs"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"regex": ""}, "structured_outputs.regex"),
    ],
)
def test_malformed_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(**kwargs)
    assert err.value.param == field


def test_not_allowed_with_beam_search() -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(
            n=2,
            temperature=0,
            use_beam_search=True,
            structured_outputs=StructuredOutputsParams(regex="a+"),
        )
    assert err.value.param == "structured_outputs"


def test_compiled_grammars_are_cached_by_spec(llm: LLM) -> None:
    manager = llm.llm_engine.structured_output
    a = manager.compile(StructuredOutputsParams(regex="[ab]{3}"))
    assert manager.compile(StructuredOutputsParams(regex="[ab]{3}")) is a
    assert manager.compile(StructuredOutputsParams(regex="[ab]{4}")) is not a


# ---- wire format and the worker's mask ---------------------------------------------------


def test_step_message_with_a_bitmask_round_trips() -> None:
    bitmask = np.array([[1, -1, 0], [7, 0, -2]], dtype="<i4")
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    msg = ExecuteModelRequest(
        scheduled_new_reqs=[
            NewRequestData(
                req_id="a",
                prompt_token_ids=[1, 2],
                sampling_params=SamplingParams(structured_outputs=so),
                block_ids=[0],
                num_computed_tokens=0,
            )
        ],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={"a": 2, "b": 1},
        total_num_scheduled_tokens=3,
        finished_req_ids=[],
        structured_output_req_ids=["a", "b"],
        grammar_bitmask=bitmask.tobytes(),
    )
    decoded = decode_request(encode(msg))
    assert decoded == msg
    assert decoded.scheduled_new_reqs[0].sampling_params.structured_outputs == so
    assert np.array_equal(unpack_bitmask(decoded.grammar_bitmask, 2), bitmask)


@pytest.mark.parametrize("vocab", [64, 80, 50], ids=["exact", "padded_logits", "short_logits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_masks_only_its_rows_and_disallowed_tokens(vocab: int, dtype: torch.dtype) -> None:
    bitmask = np.zeros((1, 2), dtype="<i4")
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[0, 1] = 1 << 3  # token 35
    logits = torch.zeros(3, vocab, dtype=dtype)
    apply_grammar_bitmask(logits, bitmask, [1])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == [t for t in (0, 2, 35) if t < vocab]
    assert torch.isfinite(logits[[0, 2]]).all()


# These two watch xgrammar itself (the engine rewrites the rule:
# engine/core/json_string_grammar.py); when they pass, a fixed release is out and the rewrite can
# go.
@pytest.mark.xfail(strict=True, reason="xgrammar 0.2.8: maxLength strings admit U+0000-U+001F")
def test_xgrammar_max_length_string_admits_control_characters(llm: LLM) -> None:
    compiler = llm.llm_engine.structured_output.compiler()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema({"type": "string", "maxLength": 4}))
    assert not matcher.accept_string('"a\x01"')


@pytest.mark.xfail(strict=True, reason="xgrammar 0.2.8: maxLength strings refuse escapes")
def test_xgrammar_max_length_string_refuses_escapes(llm: LLM) -> None:
    compiler = llm.llm_engine.structured_output.compiler()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema({"type": "string", "maxLength": 4}))
    assert matcher.accept_string('"a\\t"')


def test_max_length_strings_refuse_control_characters_and_take_escapes(llm: LLM) -> None:
    manager = llm.llm_engine.structured_output
    compiled = manager.compile(StructuredOutputsParams(json={"type": "string", "maxLength": 4}))
    assert not xgr.GrammarMatcher(compiled).accept_string('"a\x01"')
    assert xgr.GrammarMatcher(compiled).accept_string('"a\\t"')
