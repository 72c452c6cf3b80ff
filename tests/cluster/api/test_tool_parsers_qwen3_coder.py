"""Qwen3-Coder's tool calls (``qwen3_coder``): the expected values were recorded from vLLM
0.32's own ``qwen3_coder`` parser (its whole-text ``parse``) on the same texts and tools; where
this parser differs from vLLM on purpose, the test says so."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from cluster.api.openai_models import ChatCompletionRequest
from cluster.api.openai_payloads import ToolChoice, tool_choice
from cluster.api.openai_responses import parse_tool_calls, tool_streamer
from cluster.api.tool_calls import ParsedToolCalls, fold_deltas
from cluster.api.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.cluster.api.test_tool_parsers import text_splits

WEATHER: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}]  # fmt: skip
TYPED: list[dict[str, Any]] = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
        "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": "array"},
        "z": {"type": "null"}, "sn": {"type": ["string", "null"]},
        "in": {"type": ["integer", "null"]},
        "any": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "one": {"oneOf": [{"type": "boolean"}, {"type": "object"}]},
        "e": {"enum": [1, 2, 3]}, "es": {"enum": ["x", "y"]}, "eb": {"enum": [True, None]},
        "al": {"type": "int"}, "fl": {"type": "double"}, "unk": {"type": "weird"},
        "no": {"description": "no type"},
        "nested": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "arr_int": {"type": "array", "items": {"type": "integer"}}}}}}]  # fmt: skip

# name: (text, tools, content, [(name, arguments)]), as vLLM 0.32 parses the whole text.
VLLM_CASES = {
    "one call": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "Tokyo", "days": 3}')],
    ),
    "content before": (
        (
            "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
        ),
        WEATHER,
        "Let me check.",
        [("get_weather", '{"city": "Tokyo", "days": 3}')],
    ),
    "two blocks": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
            "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
            "</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "Tokyo", "days": 3}'), ("get_weather", '{"city": "Paris"}')],
    ),
    "two functions one block": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n"
            "</function>\n<function=get_weather>\n<parameter=city>\nOsaka\n</parameter>\n"
            "</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "Tokyo"}'), ("get_weather", '{"city": "Osaka"}')],
    ),
    "unknown function": (
        (
            "<tool_call>\n<function=other>\n<parameter=days>\n3\n</parameter>\n</function>"
            "\n</tool_call>"
        ),
        WEATHER,
        None,
        [("other", '{"days": "3"}')],
    ),
    "param not in schema": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=extra>\n42\n</parameter>\n"
            "</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"extra": "42"}')],
    ),
    "no params": (
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
        WEATHER,
        None,
        [("get_weather", "{}")],
    ),
    "value newlines": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n\nTokyo\n\n</parameter>"
            "\n</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "\\nTokyo\\n"}')],
    ),
    "value spaces": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>  Tokyo  </parameter>\n"
            "<parameter=days> 3 </parameter>\n</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "  Tokyo  ", "days": 3}')],
    ),
    "value inline": (
        (
            "<tool_call><function=get_weather><parameter=city>Tokyo</parameter>"
            "<parameter=days>3</parameter></function></tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "Tokyo", "days": 3}')],
    ),
    "multiline code": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\ndef f():\n"
            '    return "é\\n"\n\n</parameter>\n</function>\n</tool_call>'
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "def f():\\n    return \\"é\\\\n\\"\\n"}')],
    ),
    "unicode": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n東京 ☃\n</parameter>\n"
            "</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "東京 ☃"}')],
    ),
    "int not parsing": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
            "</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"days": "three"}')],
    ),
    "int as float": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=days>\n3.5\n</parameter>\n"
            "</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"days": 3.5}')],
    ),
    "int as bool": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=days>\ntrue\n</parameter>\n"
            "</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"days": true}')],
    ),
    "unclosed param before next": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n<parameter=days>"
            "\n3\n</parameter>\n</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "Tokyo", "days": 3}')],
    ),
    "cut in value": (
        (
            "Hi\n<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>"
            "\n<parameter=days>\n3"
        ),
        WEATHER,
        "Hi",
        [("get_weather", '{"city": "Tokyo"}')],
    ),
    "cut after param": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n",
        WEATHER,
        None,
        [("get_weather", '{"city": "Tokyo"}')],
    ),
    "cut in name": (
        "Hi <tool_call>\n<function=get_wea",
        WEATHER,
        "Hi",
        [("get_wea", "{}")],
    ),
    "cut after tool_call": (
        "Hi <tool_call>\n",
        WEATHER,
        "Hi ",
        [],
    ),
    "cut in tag": (
        "Hi <tool_ca",
        WEATHER,
        "Hi <tool_ca",
        [],
    ),
    "cut after function end": (
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n</function>"),
        WEATHER,
        None,
        [("get_weather", '{"city": "X"}')],
    ),
    "bare function": (
        ("Text <function=get_weather>\n<parameter=city>\nX\n</parameter>\n</function> tail"),
        WEATHER,
        "Text",
        [("get_weather", '{"city": "X"}')],
    ),
    "empty block": (
        "a <tool_call>\n</tool_call> b",
        WEATHER,
        "a  b",
        [],
    ),
    "junk in preamble": (
        (
            "<tool_call>junk<function=get_weather><parameter=city>X</parameter></function>"
            "junk2</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "X"}')],
    ),
    "name spaces": (
        (
            "<tool_call>\n<function= get_weather >\n<parameter=city>X</parameter>\n"
            "</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "X"}')],
    ),
    "name unclosed then end": (
        "<tool_call>\n<function=get_weather</function>\n</tool_call>",
        WEATHER,
        None,
        [("get_weather", "{}")],
    ),
    "empty name": (
        ("<tool_call>\n<function=>\n<parameter=city>X</parameter>\n</function>\n</tool_call>"),
        WEATHER,
        None,
        [],
    ),
    "param name spaces": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter = city >X</parameter>\n"
            "</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city ": "X"}')],
    ),
    "think end in content": (
        "ok</think>\nHello",
        WEATHER,
        "ok</think>\nHello",
        [],
    ),
    "think start in content": (
        "<think>hmm</think>Hello",
        WEATHER,
        "<think>hmm</think>Hello",
        [],
    ),
    "plain": (
        "Just text, no calls.",
        WEATHER,
        "Just text, no calls.",
        [],
    ),
    "plain ws": (
        "\n  Just text  \n",
        WEATHER,
        "\n  Just text  \n",
        [],
    ),
    "lt in content": (
        "a < b and <tool> x",
        WEATHER,
        "a < b and <tool> x",
        [],
    ),
    "leading ws before call": (
        (
            "\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>"
            "\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "Tokyo", "days": 3}')],
    ),
    "text after call ws": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n\n"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "Tokyo", "days": 3}')],
    ),
    "tool_call text in value": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\na<tool_call>b\n"
            "</parameter>\n</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "a<tool_call>b"}')],
    ),
    "gt in value": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\na > b\n</parameter>\n"
            "</function>\n</tool_call>"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "a > b"}')],
    ),
    "all types in one": (
        (
            "<tool_call>\n<function=f>\n<parameter=s>\na\n</parameter>\n<parameter=i>\n1\n"
            "</parameter>\n<parameter=n>\n2.5\n</parameter>\n<parameter=b>\nfalse\n"
            '</parameter>\n<parameter=o>\n{"q": [1]}\n</parameter>\n<parameter=z>\nnull\n'
            "</parameter>\n</function>\n</tool_call>"
        ),
        TYPED,
        None,
        [("f", '{"s": "a", "i": 1, "n": 2.5, "b": false, "o": {"q": [1]}, "z": null}')],
    ),
    "missing function end": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n"
            "</tool_call>\nafter"
        ),
        WEATHER,
        None,
        [("get_weather", '{"city": "X"}')],
    ),
    "tag in a name": (
        "<function=  </tool_call>\n<tool_call>x</parameter>\n</function>",
        WEATHER,
        None,
        [("</tool_call>\n<tool_call>x</parameter>", "{}")],
    ),
}

# (parameter, its text, arguments) of a call to TYPED's ``f``, as vLLM 0.32 types it.
TYPE_TABLE = [
    ("s", "hello", '{"s": "hello"}'),
    ("s", "123", '{"s": "123"}'),
    ("s", "null", '{"s": "null"}'),
    ("i", "42", '{"i": 42}'),
    ("i", "-7", '{"i": -7}'),
    ("i", "+7", '{"i": 7}'),
    ("i", "1_000", '{"i": 1000}'),
    ("i", "4.0", '{"i": 4.0}'),
    ("i", "x", '{"i": "x"}'),
    ("n", "3.14", '{"n": 3.14}'),
    ("n", "2.0", '{"n": 2}'),
    ("n", "1e3", '{"n": 1000}'),
    ("n", "inf", '{"n": "inf"}'),
    ("n", "nan", '{"n": "nan"}'),
    ("n", "abc", '{"n": "abc"}'),
    ("n", "-0.5", '{"n": -0.5}'),
    ("b", "true", '{"b": true}'),
    ("b", "True", '{"b": true}'),
    ("b", "FALSE", '{"b": false}'),
    ("b", "1", '{"b": true}'),
    ("b", "0", '{"b": false}'),
    ("b", "yes", '{"b": "yes"}'),
    ("b", " true ", '{"b": true}'),
    ("o", '{"a": 1, "b": [1, 2]}', '{"o": {"a": 1, "b": [1, 2]}}'),
    ("o", "{bad", '{"o": "{bad"}'),
    ("o", "[1]", '{"o": [1]}'),
    ("o", "3", '{"o": 3}'),
    ("a", '[1, "x", {"k": null}]', '{"a": [1, "x", {"k": null}]}'),
    ("a", "[1e999]", '{"a": "[1e999]"}'),
    ("a", "not a list", '{"a": "not a list"}'),
    ("z", "null", '{"z": null}'),
    ("z", "NULL", '{"z": null}'),
    ("z", "None", '{"z": "None"}'),
    ("sn", "null", '{"sn": null}'),
    ("sn", "text", '{"sn": "text"}'),
    ("in", "null", '{"in": null}'),
    ("in", "5", '{"in": 5}'),
    ("in", "x", '{"in": "x"}'),
    ("any", "5", '{"any": 5}'),
    ("any", "five", '{"any": "five"}'),
    ("one", "true", '{"one": true}'),
    ("one", '{"x": 1}', '{"one": {"x": 1}}'),
    ("one", "zz", '{"one": "zz"}'),
    ("e", "2", '{"e": 2}'),
    ("e", "q", '{"e": "q"}'),
    ("es", "x", '{"es": "x"}'),
    ("eb", "true", '{"eb": true}'),
    ("eb", "null", '{"eb": null}'),
    ("al", "12", '{"al": 12}'),
    ("fl", "1.5", '{"fl": 1.5}'),
    ("unk", "12", '{"unk": 12}'),
    ("unk", "word", '{"unk": "word"}'),
    ("unk", "1e999", '{"unk": "1e999"}'),
    ("no", "12", '{"no": "12"}'),
    ("nested", '{"x": "5", "y": 1}', '{"nested": {"x": "5", "y": 1}}'),
    ("arr_int", '["1", 2]', '{"arr_int": ["1", 2]}'),
    ("undeclared", "12", '{"undeclared": "12"}'),
    ("s", 'é"\\\t', '{"s": "é\\"\\\\\\t"}'),
    ("o", '{"u": "é"}', '{"o": {"u": "é"}}'),
]


_MESSAGES = [{"role": "user", "content": "hi"}]


def _parser(tools: list[dict[str, Any]]) -> Any:
    """The parser as a chat request with ``tools`` gets it (through ``ToolChoice``)."""
    choice = tool_choice(ChatCompletionRequest(model="m", messages=_MESSAGES, tools=tools))
    assert choice is not None
    return get_tool_parser("qwen3_coder", choice.parameter_schemas)


def _calls(parsed: ParsedToolCalls) -> tuple[str | None, list[tuple[str, str]]]:
    return parsed.content, [(call.name, call.arguments) for call in parsed.tool_calls]


def _streamed(tools: list[dict[str, Any]] | Any, pieces: list[str]) -> ParsedToolCalls:
    streamer = (_parser(tools) if isinstance(tools, list) else tools).streamer()
    deltas = [d for piece in pieces for d in streamer.feed(piece)] + streamer.finish()
    return fold_deltas(deltas)


def _token_like(text: str) -> list[str]:
    """Pieces as a Qwen tokenizer cuts them: the block tags whole, ``<function=`` in parts."""
    return re.findall(r"</?tool_call>|<|/|=|>|\n|[A-Za-z_]+|[^<>/=\nA-Za-z_]+", text)


def _typed_call(key: str, value: str) -> str:
    param = f"<parameter={key}>\n{value}\n</parameter>\n"
    return f"<tool_call>\n<function=f>\n{param}</function>\n</tool_call>"


def test_qwen3_coder_is_registered_and_keeps_special_tokens() -> None:
    parser = get_tool_parser("qwen3_coder")
    assert type(parser) is TOOL_PARSERS["qwen3_coder"]
    assert parser.keeps_special_tokens


@pytest.mark.parametrize("case", sorted(VLLM_CASES))
def test_whole_text_as_vllm(case: str) -> None:
    text, tools, content, calls = VLLM_CASES[case]
    assert _calls(_parser(tools).parse(text)) == (content, calls)


@pytest.mark.parametrize("case", sorted(VLLM_CASES))
def test_any_chunking_folds_to_the_whole_text_split(case: str) -> None:
    text, tools, content, calls = VLLM_CASES[case]
    parser = _parser(tools)
    for pieces in [_token_like(text), *text_splits(text)]:
        assert "".join(pieces) == text
        assert _calls(_streamed(parser, pieces)) == (content, calls), pieces


@pytest.mark.parametrize(("key", "value", "arguments"), TYPE_TABLE)
def test_a_parameter_is_typed_by_its_schema_as_vllm(key: str, value: str, arguments: str) -> None:
    assert _calls(_parser(TYPED).parse(_typed_call(key, value))) == (None, [("f", arguments)])


def test_without_schemas_every_value_is_a_string() -> None:
    text = VLLM_CASES["one call"][0]
    parsed = get_tool_parser("qwen3_coder").parse(text)
    assert _calls(parsed) == (None, [("get_weather", '{"city": "Tokyo", "days": "3"}')])


def test_text_after_the_calls_stays_content() -> None:
    # vLLM's whole-text parse drops it ("Sure."), its stream keeps it: we keep it both ways.
    text = "Sure.\n\n" + VLLM_CASES["one call"][0] + "\nDone here."
    for pieces in [[text], _token_like(text), list(text)]:
        assert _streamed(WEATHER, pieces).content == "Sure.\n\n\nDone here."
    mid = "A " + VLLM_CASES["one call"][0] + " mid " + VLLM_CASES["one call"][0] + " end"
    parsed = _parser(WEATHER).parse(mid)
    assert parsed.content == "A  mid  end" and len(parsed.tool_calls) == 2


def test_a_repeated_parameter_keeps_both_and_reads_as_the_last() -> None:
    # vLLM's dict keeps the last value at the first place ({"city": "B", "days": 1}) and its
    # stream, having sent "A", stops mid-object; streamed per parameter we cannot take a value
    # back, so both go out and a JSON reader takes the last, as vLLM's value.
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
            "<parameter=days>\n1\n</parameter>\n<parameter=city>\nB\n</parameter>\n"
            "</function>\n</tool_call>")  # fmt: skip
    (call,) = _parser(WEATHER).parse(text).tool_calls
    assert call.arguments == '{"city": "A", "days": 1, "city": "B"}'
    assert json.loads(call.arguments) == {"city": "B", "days": 1}


def test_a_stream_sends_the_header_at_the_name_and_each_parameter_once_closed() -> None:
    streamer = _parser(WEATHER).streamer()
    assert streamer.feed("Checking.\n<tool_call>\n<function=get_wea") == [{"content": "Checking."}]
    (header,) = streamer.feed("ther>\n<parameter=city>\nTok")
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert streamer.tools_called
    assert streamer.feed("yo\n</parameter>\n<parameter=days>\n3") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Tokyo"'}}]}
    ]
    assert streamer.feed("\n</parameter>\n</function>\n</tool_call>\n") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ', "days": 3}'}}]}
    ]
    assert streamer.finish() == []


def test_held_back_text_is_released_at_finish() -> None:
    streamer = _parser(WEATHER).streamer()
    assert streamer.feed("Hi <tool_ca") == [{"content": "Hi"}]
    assert streamer.finish() == [{"content": " <tool_ca"}]
    streamer = _parser(WEATHER).streamer()
    assert streamer.feed("no call\n\n") == [{"content": "no call"}]
    assert streamer.finish() == [{"content": "\n\n"}]


def test_a_chat_requests_tool_schemas_reach_the_parser() -> None:
    req = ChatCompletionRequest(model="m", messages=_MESSAGES, tools=TYPED)
    choice = tool_choice(req)
    assert isinstance(choice, ToolChoice)
    assert choice.parameter_schemas[("f", "i")] == {"type": "integer"}
    strings = get_tool_parser("glm45", choice.parameter_schemas).string_parameters
    assert ("f", "s") in strings and ("f", "i") not in strings
    text = _typed_call("i", "7")
    assert _calls(parse_tool_calls(choice, "qwen3_coder", text)) == (None, [("f", '{"i": 7}')])
    streamer = tool_streamer(choice, "qwen3_coder")
    assert _calls(fold_deltas(streamer.feed(text) + streamer.finish()))[1] == [("f", '{"i": 7}')]


def test_a_parameter_end_tag_cut_between_pieces_still_sends_it() -> None:
    streamer = _parser(WEATHER).streamer()
    streamer.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</para")
    assert streamer.feed("meter>\n") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"'}}]}
    ]
