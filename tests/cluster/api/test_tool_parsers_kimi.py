"""Kimi K2's tool calls (``kimi_k2``): whole and streamed in any split, against what vLLM 0.32's
``kimi_k2`` parser gives for the same text (recorded from it; where vLLM is broken, the
difference is noted at the case)."""

from __future__ import annotations

import pytest

from cluster.api.tool_calls import Delta, ParsedToolCalls, ToolCallStreamer, fold_deltas
from cluster.api.tool_parsers import TOOL_PARSERS, get_tool_parser
from cluster.api.tool_parsers_kimi import ARGUMENT_BEGIN as A
from cluster.api.tool_parsers_kimi import CALL_BEGIN as B
from cluster.api.tool_parsers_kimi import CALL_END as C
from cluster.api.tool_parsers_kimi import SECTION_BEGIN as S
from cluster.api.tool_parsers_kimi import SECTION_END as E
from cluster.api.tool_parsers_kimi import KimiK2ToolParser, read_call_header

Calls = list[tuple[str, str, str]]

# text: (content, [(id, name, arguments)]), as vLLM 0.32's kimi_k2 parser reads the whole text.
VLLM_CASES: dict[str, tuple[str, str | None, Calls]] = {
    "basic": (
        f'{S}{B}functions.get_weather:0{A}{{"city": "Tokyo"}}{C}{E}',
        None,
        [("functions.get_weather:0", "get_weather", '{"city": "Tokyo"}')],
    ),
    "spaced": (
        f'{S}\n{B}functions.get_weather:0\n{A}{{"city": "Tokyo"}}{C}\n{E}',
        None,
        [("functions.get_weather:0", "get_weather", '{"city": "Tokyo"}')],
    ),
    "content before": (
        f'Let me check.{S}{B}functions.get_weather:0{A}{{"city": "Tokyo"}}{C}{E}',
        "Let me check.",
        [("functions.get_weather:0", "get_weather", '{"city": "Tokyo"}')],
    ),
    "content ws before": (
        f'  \n{S}{B}functions.get_weather:0{A}{{"city": "Tokyo"}}{C}{E}',
        None,
        [("functions.get_weather:0", "get_weather", '{"city": "Tokyo"}')],
    ),
    "content before ws": (
        f'Let me check. \n {S}{B}functions.get_weather:0{A}{{"city": "Tokyo"}}{C}{E}',
        "Let me check. \n ",
        [("functions.get_weather:0", "get_weather", '{"city": "Tokyo"}')],
    ),
    "content nl before": (
        f'Sure!\n\n{S}{B}functions.f:0{A}{{"a": 1}}{C}{E}',
        "Sure!\n\n",
        [("functions.f:0", "f", '{"a": 1}')],
    ),
    "two": (
        f'{S}{B}functions.get_weather:0{A}{{"city": "Tokyo"}}{C}'
        f'{B}functions.search:1{A}{{"q": "x y", "n": 3}}{C}{E}',
        None,
        [
            ("functions.get_weather:0", "get_weather", '{"city": "Tokyo"}'),
            ("functions.search:1", "search", '{"q": "x y", "n": 3}'),
        ],
    ),
    "two nl": (
        f'{S}\n{B}functions.get_weather:0\n{A}{{"city": "Tokyo"}}{C}\n'
        f'{B}functions.search:1\n{A}  {{"q": "x"}}  \n{C}\n{E}',
        None,
        [
            ("functions.get_weather:0", "get_weather", '{"city": "Tokyo"}'),
            ("functions.search:1", "search", '{"q": "x"}'),
        ],
    ),
    "three calls same name": (
        f'I will call three times.\n{S}\n{B}functions.get_weather:0\n{A}{{"city": "A"}}{C}\n'
        f'{B}functions.get_weather:1\n{A}{{"city": "B"}}{C}\n'
        f'{B}functions.get_weather:2\n{A}{{"city": "C"}}{C}\n{E}',
        "I will call three times.\n",
        [
            ("functions.get_weather:0", "get_weather", '{"city": "A"}'),
            ("functions.get_weather:1", "get_weather", '{"city": "B"}'),
            ("functions.get_weather:2", "get_weather", '{"city": "C"}'),
        ],
    ),
    "after": (
        f"hi{S}{B}functions.f:0{A}{{}}{C}{E} trailing text",
        "hi",
        [("functions.f:0", "f", "{}")],
    ),
    "two sections": (
        f'{S}{B}functions.f:0{A}{{}}{C}{E}mid{S}{B}functions.search:1{A}{{"q": 1}}{C}{E}',
        None,
        [("functions.f:0", "f", "{}"), ("functions.search:1", "search", '{"q": 1}')],
    ),
    "text in section": (
        f'{S}junk{B}functions.f:0{A}{{"a": 1}}{C}junk2{E}',
        None,
        [("functions.f:0", "f", '{"a": 1}')],
    ),
    "none": ("Just text, no calls.", "Just text, no calls.", []),
    "empty": ("", None, []),
    "ws only no calls": ("  \n ", "  \n ", []),
    "ws then section cut": (f"  {S}", "  ", []),
    "ws then bad call": (f"  {S}{B}junk{A}{{}}{C}{E}", None, []),
    "cut in args": (
        f'ok {S}{B}functions.get_weather:0{A}{{"city": "To',
        "ok ",
        [("functions.get_weather:0", "get_weather", '{"city": "To')],
    ),
    "cut after section": (f"ok {S}", "ok ", []),
    "cut after header": (
        f"{S}{B}functions.get_weather:0",
        None,
        [("functions.get_weather:0", "get_weather", "{}")],
    ),
    "cut after arg begin": (
        f"{S}{B}functions.get_weather:0{A}",
        None,
        [("functions.get_weather:0", "get_weather", "{}")],
    ),
    "cut partial marker args": (
        f'{S}{B}functions.f:0{A}{{"a": 1}}<|tool_ca',
        None,
        [("functions.f:0", "f", '{"a": 1}<|tool_ca')],
    ),
    "cut partial marker header": (
        f"{S}{B}functions.f:0<|tool_ca",
        None,
        [("functions.f:0", "f", "{}")],
    ),
    "cut partial marker content": ("hello <|tool_calls_sec", "hello <|tool_calls_sec", []),
    "no section end": (
        f'{S}{B}functions.f:0{A}{{"a": 1}}{C}',
        None,
        [("functions.f:0", "f", '{"a": 1}')],
    ),
    "section end in args": (
        f'{S}{B}functions.f:0{A}{{"a": 1}}{E}',
        None,
        [("functions.f:0", "f", '{"a": 1}')],
    ),
    "bad json": (
        f'{S}{B}functions.f:0{A}{{"a": 1,{C}{E}',
        None,
        [("functions.f:0", "f", '{"a": 1,')],
    ),
    "non object": (f"{S}{B}functions.f:0{A}[1, 2]{C}{E}", None, [("functions.f:0", "f", "[1, 2]")]),
    "bad header": (f'{S}{B}get_weather{A}{{"a": 1}}{C}{E}', None, []),
    "bad then good": (
        f'{S}{B}junk{A}{{"a": 1}}{C}{B}functions.g:1{A}{{"b": 2}}{C}{E}',
        None,
        [("functions.g:1", "g", '{"b": 2}')],
    ),
    "no prefix": (
        f'{S}{B}get_weather:3{A}{{"a": 1}}{C}{E}',
        None,
        [("get_weather:3", "get_weather", '{"a": 1}')],
    ),
    "dotted": (
        f'{S}{B}functions.my.tool:0{A}{{"a": 1}}{C}{E}',
        None,
        [("functions.my.tool:0", "my.tool", '{"a": 1}')],
    ),
    "colon name": (
        f'{S}{B}functions.ns:tool:2{A}{{"a": 1}}{C}{E}',
        None,
        [("functions.ns:tool:2", "ns", '{"a": 1}')],
    ),
    "double colon": (f"{S}{B}::0{A}{{}}{C}{E}", None, []),
    "empty name": (f"{S}{B}functions.:0{A}{{}}{C}{E}", None, []),
    "multiline header": (
        f"{S}{B}functions.f:0\nfoo{A}{{}}{C}{E}",
        None,
        [("functions.f:0", "f", "{}")],
    ),
    "multiline header2": (f"{S}{B}foo\nfunctions.f:0{A}{{}}{C}{E}", None, []),
    "header spaces": (
        f'{S}{B}  functions.f:0  {A}{{"a": 1}}{C}{E}',
        None,
        [("functions.f:0", "f", '{"a": 1}')],
    ),
    "header suffix": (
        f"{S}{B}functions.f:0 extra{A}{{}}{C}{E}",
        None,
        [("functions.f:0", "f", "{}")],
    ),
    "empty args": (f"{S}{B}functions.f:0{A}{C}{E}", None, [("functions.f:0", "f", "{}")]),
    "ws args": (f"{S}{B}functions.f:0{A}  {C}{E}", None, [("functions.f:0", "f", "{}")]),
    "args inner ws": (
        f'{S}{B}functions.f:0{A}\n  {{\n  "a": 1\n}}\n{C}{E}',
        None,
        [("functions.f:0", "f", '{\n  "a": 1\n}')],
    ),
    "args unicode ws": (
        f'{S}{B}functions.f:0{A}\xa0{{"a": 1}}\u3000{C}{E}',
        None,
        [("functions.f:0", "f", '{"a": 1}')],
    ),
    "nested": (
        f'{S}{B}functions.f:0{A}{{"a": {{"b": [1, 2, {{"c": "}}"}}]}}, "u": "\\u00e9 é"}}{C}{E}',
        None,
        [("functions.f:0", "f", '{"a": {"b": [1, 2, {"c": "}"}]}, "u": "\\u00e9 é"}')],
    ),
    "escaped json": (
        f'{S}{B}functions.f:0{A}{{"s": "a\\"b\\\\", "n": null, "t": true}}{C}{E}',
        None,
        [("functions.f:0", "f", '{"s": "a\\"b\\\\", "n": null, "t": true}')],
    ),
    "argbegin in args": (
        f'{S}{B}functions.f:0{A}{{"a": 1}}{A}x{C}{E}',
        None,
        [("functions.f:0", "f", f'{{"a": 1}}{A}x')],
    ),
    "section begin in args": (
        f'{S}{B}functions.f:0{A}{{"a": 1}}{S}{C}{E}',
        None,
        [("functions.f:0", "f", f'{{"a": 1}}{S}')],
    ),
    "section begin in header": (
        f'{S}{B}functions.f:0{S}{A}{{"a": 1}}{C}{E}',
        None,
        [("functions.f:0", "f", '{"a": 1}')],
    ),
    "no arg begin": (f"{S}{B}functions.f:0{C}{E}", None, [("functions.f:0", "f", "{}")]),
    "call no section": (
        f'{B}functions.f:0{A}{{"a": 1}}{C}',
        f'{B}functions.f:0{A}{{"a": 1}}{C}',
        [],
    ),
    "stray end": (f"text {C} more", f"text {C} more", []),
    "partial marker text": ("text <|tool_calls_sec more", "text <|tool_calls_sec more", []),
    "think": (
        f"<think>x</think>hello{S}{B}functions.f:0{A}{{}}{C}{E}",
        "<think>x</think>hello",
        [("functions.f:0", "f", "{}")],
    ),
    "unicode content": (
        f'héllo 日本 {S}{B}functions.f:0{A}{{"s": "日本"}}{C}{E}',
        "héllo 日本 ",
        [("functions.f:0", "f", '{"s": "日本"}')],
    ),
    "history index": (
        f'{S}{B}functions.search:7{A}{{"q": "a"}}{C}{E}',
        None,
        [("functions.search:7", "search", '{"q": "a"}')],
    ),
}

# Where vLLM 0.32 is broken, the sensible reading (vLLM's in the comment).
FIXED_CASES: dict[str, tuple[str, str | None, Calls]] = {
    # vLLM: a call named "functions.get_wea" with a random id.
    "cut in the header": (f"ok {S}{B}functions.get_wea", "ok ", []),
    # vLLM: a call named "junk" with a random id.
    "cut in a header that is no id": (f"  {S}{B}junk", None, []),
    # vLLM: a call named "x" (read from the arguments) with a random id.
    "header that is no id, a name in the arguments": (
        f'{S}{B}junk{A}{{"name": "x", "arguments": {{"a": 1}}}}{C}{E}',
        None,
        [],
    ),
    # vLLM: one call, f, whose arguments run on through the second call.
    "a call begins before the last one ended": (
        f'{S}{B}functions.f:0{A}{{"a": 1}}{B}functions.g:1{A}{{"b": 2}}{C}{E}',
        None,
        [("functions.f:0", "f", '{"a": 1}'), ("functions.g:1", "g", '{"b": 2}')],
    ),
    # vLLM: one call, id "functions.f:0<|tool_call_begin|>functions.g:1", name f.
    "a call begins in the last one's header": (
        f'{S}{B}functions.f:0{B}functions.g:1{A}{{"b": 2}}{C}{E}',
        None,
        [("functions.f:0", "f", "{}"), ("functions.g:1", "g", '{"b": 2}')],
    ),
    # vLLM: id "functions.f:0<|tool_call_end|> junk<|tool_calls_section_end|> Done at 10:30".
    "a header without arguments, then text": (
        f"{S}{B}functions.f:0{C} junk{E} Done at 10:30",
        None,
        [("functions.f:0", "f", "{}")],
    ),
}

ALL_CASES = {**VLLM_CASES, **FIXED_CASES}


def _calls(parsed: ParsedToolCalls) -> tuple[str | None, Calls]:
    return parsed.content, [(c.id, c.name, c.arguments) for c in parsed.tool_calls]


def _stream(streamer: ToolCallStreamer, pieces: list[str]) -> list[Delta]:
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += streamer.feed(piece)
    return deltas + streamer.finish()


def _splits(text: str) -> list[list[str]]:
    """One character at a time, in two at every point, and in three at some."""
    splits = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    return splits + [[text[:i], text[i:j], text[j:]] for i in range(0, len(text), 7)
                     for j in range(i, len(text), 11)]  # fmt: skip


def test_registered_as_kimi_k2_reading_special_tokens() -> None:
    assert TOOL_PARSERS["kimi_k2"] is KimiK2ToolParser
    assert type(get_tool_parser("kimi_k2")) is KimiK2ToolParser
    assert KimiK2ToolParser.keeps_special_tokens


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_whole_text_reads_as_vllm_does(case: str) -> None:
    text, content, calls = ALL_CASES[case]
    assert _calls(get_tool_parser("kimi_k2").parse(text)) == (content, calls)


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_streaming_in_any_split_gives_the_whole_text_result(case: str) -> None:
    text, content, calls = ALL_CASES[case]
    parser = get_tool_parser("kimi_k2")
    for pieces in _splits(text):
        streamer = parser.streamer()
        assert _calls(fold_deltas(_stream(streamer, pieces))) == (content, calls), pieces
        assert streamer.tools_called == bool(calls)


def test_call_ids_are_the_headers_the_model_writes() -> None:
    assert read_call_header(" functions.get_weather:12\n") == (
        "functions.get_weather:12",
        "get_weather",
    )
    assert read_call_header("functions.ns:tool:2") == ("functions.ns:tool:2", "ns")
    assert read_call_header("search:3") == ("search:3", "search")
    for header in ("functions.f", "functions.:0", ":0", "", "f\nfunctions.g:1"):
        assert read_call_header(header) is None, header


def test_stream_sends_the_header_at_the_arguments_then_their_fragments() -> None:
    streamer = KimiK2ToolParser().streamer()

    assert streamer.feed(f"Let me check.{S}{B}functions.get_weather:0") == [
        {"content": "Let me check."}
    ]
    assert not streamer.tools_called
    header = {"index": 0, "id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
    assert streamer.feed(f'{A} {{"city": ') == [
        {"tool_calls": [header]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]},
    ]
    assert streamer.tools_called
    # Whitespace waits until text after it shows it is inside the arguments.
    assert streamer.feed('"Oslo"}\n') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ' "Oslo"}'}}]}
    ]
    assert streamer.feed(f"{C}{E}") == []
    assert streamer.finish() == []


def test_stream_holds_a_possible_marker_and_releases_it_at_the_end() -> None:
    streamer = KimiK2ToolParser().streamer()

    assert streamer.feed("a <|tool_calls_") == [{"content": "a "}]
    assert streamer.finish() == [{"content": "<|tool_calls_"}]


def test_stream_numbers_the_calls_from_zero_past_a_header_that_is_no_call() -> None:
    streamer = KimiK2ToolParser().streamer()
    deltas = _stream(streamer, [f"{S}{B}junk{A}{{}}{C}{B}functions.g:1{A}{{}}{C}{E}"])

    # vLLM numbers this call 1.
    assert [entry["index"] for d in deltas for entry in d["tool_calls"]] == [0, 0]


def test_whitespace_only_content_goes_out_at_the_end_when_no_call_began() -> None:
    streamer = KimiK2ToolParser().streamer()

    assert streamer.feed(" \n") == []
    assert streamer.finish() == [{"content": " \n"}]
