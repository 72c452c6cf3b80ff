"""Length-bounded JSON strings are JSON strings: no raw control characters, escapes count as the
character they spell (the xgrammar 0.2.8 workaround in engine/core/json_string_grammar.py), and a
forced tool call's arguments always parse with strict ``json.loads``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from cluster.api.forced_tool_calls import named_tool_schema, required_tools_schema
from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.core.json_string_grammar import json_schema_grammar

BOUNDED = {
    "type": "object",
    "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 2}},
    "required": ["s"],
    "additionalProperties": False,
}
BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "note": {"type": "string", "minLength": 1, "maxLength": 20},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 6},
                    "maxItems": 3,
                },
            },
            "required": ["city", "note", "tags"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 16}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}


def _accepts(grammar: xgr.Grammar, value: str) -> bool:
    return _is_grammar_accept_string(grammar, '{"s": "' + value + '"}')


@pytest.fixture(scope="module")
def bounded() -> xgr.Grammar:
    return json_schema_grammar(json.dumps(BOUNDED), any_whitespace=False)


@pytest.mark.parametrize("char", ["\x00", "\x01", "\t", "\x0b", "\x1b", "\x1f", "\n", "\r"])
def test_raw_control_characters_are_refused(bounded: xgr.Grammar, char: str) -> None:
    assert not _accepts(bounded, "a" + char)


@pytest.mark.parametrize(
    "value",
    ["a", "ab", "\x7f", "é😀", r"\t", r"\"x", r"\\\/", r"\u0041\u00e9", r"\ud83d\ude00z", r"\b\f"],
)
def test_every_json_spelling_of_up_to_two_characters_is_accepted(
    bounded: xgr.Grammar, value: str
) -> None:
    assert len(json.loads(f'"{value}"')) <= 2
    assert _accepts(bounded, value)


@pytest.mark.parametrize("value", ["", "abc", r"\t\n\r", r"\u0041bc", r"\x", r"\u12", r"\ud800"])
def test_what_json_or_the_length_bound_forbids_is_refused(bounded: xgr.Grammar, value: str) -> None:
    # \ud800: a lone surrogate is valid JSON text but no code point; refused like upstream's fix.
    assert not _accepts(bounded, value)


def test_grammar_without_bounded_strings_is_xgrammars_own() -> None:
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": "^[a-z]+$"}}}
    text = json.dumps(schema)
    ours = json_schema_grammar(text, any_whitespace=False)
    assert str(ours) == str(xgr.Grammar.from_json_schema(text, any_whitespace=False))


def test_rewritten_grammar_differs_from_xgrammars_only_in_the_character_rules() -> None:
    schema = required_tools_schema([BOOK, LOOKUP])
    upstream = str(xgr.Grammar.from_json_schema(json.dumps(schema))).splitlines()
    ours = str(json_schema_grammar(json.dumps(schema))).splitlines()
    assert len(ours) == len(upstream)
    changed = [(a, b) for a, b in zip(upstream, ours) if a != b]
    assert len(changed) == 4  # city, note, tags' items, query
    assert all(a.split(" ::= ")[0] == b.split(" ::= ")[0] for a, b in changed)
    assert all(a.split(" ::= ")[0].endswith("_characters") for a, _ in changed)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("builtin:tiny-llama", num_kv_blocks=256)


def _sample_json(
    llm: LLM, schema: dict[str, Any], seeds: range, *, compact: bool = False, max_tokens: int = 300
) -> list[str]:
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=so)
        for seed in seeds
    ]
    outs = llm.generate(["Call the tool:"] * len(params), params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
    return [out.outputs[0].text for out in outs]


def test_forced_tool_call_arguments_parse_strictly_on_50_seeds(llm: LLM) -> None:
    # Without the rewrite, about half of these seeds put a raw control character in a string.
    schema = named_tool_schema(BOOK)
    for text in _sample_json(llm, schema, range(50)):
        arguments = json.loads(text)
        jsonschema.validate(arguments, schema)


def test_required_tool_calls_parse_strictly_on_20_seeds(llm: LLM) -> None:
    schema = required_tools_schema([BOOK, LOOKUP])
    # Compact: a random-weight model can spend any token budget on whitespace between calls.
    # The array of calls is unbounded: the budget leaves room for a seed that writes many.
    for text in _sample_json(llm, schema, range(100, 120), compact=True, max_tokens=600):
        jsonschema.validate(json.loads(text), schema)
