"""DeepSeek-V3 and V3.1 tool calls (``deepseek_v3``, ``deepseek_v31``): whole and streamed in
any split. Expected values are what vLLM 0.32's parsers give on the same text (whole and fed
token by token), except where a comment says why ours differ."""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

import pytest

from cluster.api.tool_calls import Delta, ParsedToolCalls, ToolCallStreamer, fold_deltas
from cluster.api.tool_parsers import TOOL_PARSERS, get_tool_parser
from cluster.api.tool_parsers_deepseek import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    TOOL_SEP,
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
)
from tests.cluster.api.test_tool_parsers import text_splits

Calls = list[tuple[str, str]]


def v3(name: str, arguments: str, kind: str = "function") -> str:
    return f"{CALL_BEGIN}{kind}{TOOL_SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def v31(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{TOOL_SEP}{arguments}{CALL_END}"


def section(*blocks: str) -> str:
    return CALLS_BEGIN + "".join(blocks) + CALLS_END


W = '{"city": "Paris", "unit": "celsius"}'
WEATHER = ("get_weather", W)
NESTED = '{"city":"東京","days":3,"opts":{"a":[1,2,{"b":null}]}}'
V3_OPEN = CALLS_BEGIN + CALL_BEGIN + "function" + TOOL_SEP + "get_weather\n```json\n"
V31_OPEN = CALLS_BEGIN + CALL_BEGIN + "get_weather" + TOOL_SEP

# name: (parser, text, content, calls) of the whole text
CASES: dict[str, tuple[str, str, str | None, Calls]] = {
    "v3 plain": ("deepseek_v3", "Hello there, no tools here.", "Hello there, no tools here.", []),
    "v3 empty": ("deepseek_v3", "", None, []),
    "v3 one": ("deepseek_v3", section(v3(*WEATHER)), None, [WEATHER]),
    "v3 content before": (
        "deepseek_v3",
        "Let me check the weather.\n\n" + section(v3(*WEATHER)),
        "Let me check the weather.\n\n",
        [WEATHER],
    ),
    # vLLM's stream sends this whitespace (and the newlines between calls) as content; its
    # whole-text message has None, as here.
    "v3 whitespace before": ("deepseek_v3", "\n\n" + section(v3(*WEATHER)), None, [WEATHER]),
    "v3 two": (
        "deepseek_v3",
        section(v3(*WEATHER), "\n", v3("get_time", '{"tz": "UTC"}')),
        None,
        [WEATHER, ("get_time", '{"tz": "UTC"}')],
    ),
    "v3 three nested": (
        "deepseek_v3",
        "Sure." + section(v3("a", NESTED), "\n", v3("b", "{}"), "\n", v3("c", '{"x": "a ```"}')),
        "Sure.",
        [("a", NESTED), ("b", "{}"), ("c", '{"x": "a ```"}')],
    ),
    "v3 unicode": (
        "deepseek_v3",
        "温度？" + section(v3("f", '{"c": "北京😀"}')),
        "温度？",
        [("f", '{"c": "北京😀"}')],
    ),
    # vLLM passes the arguments on as written, JSON or not.
    "v3 arguments not json": (
        "deepseek_v3",
        section(v3("f", "not json")),
        None,
        [("f", "not json")],
    ),
    "v3 no section": ("deepseek_v3", v3(*WEATHER), v3(*WEATHER), []),
    "v3 section start only": ("deepseek_v3", "Hi" + CALLS_BEGIN, "Hi", []),
    # Text after or between the calls: vLLM's stream sends it as content, its whole text
    # drops it.
    "v3 text after": ("deepseek_v3", section(v3(*WEATHER)) + "\nDone!", "\nDone!", [WEATHER]),
    "v3 text between": (
        "deepseek_v3",
        section(v3("f", "{}"), "\nhmm\n", v3("g", "{}")),
        "\nhmm\n",
        [("f", "{}"), ("g", "{}")],
    ),
    "v3 section of text": ("deepseek_v3", "A" + section("no calls here"), "Ano calls here", []),
    # vLLM reads arguments on one line only: whole, it drops this call; streamed, it sends "{".
    "v3 multiline arguments": (
        "deepseek_v3",
        section(v3("f", '{\n  "a": 1\n}')),
        None,
        [("f", '{\n  "a": 1\n}')],
    ),
    # Malformed blocks are content here, as written. vLLM, whole: a type other than
    # "function" makes all its text content (the good call too); an empty name is a call
    # named ""; the others it drops. Streamed: it ignores the type, sends a call with no
    # arguments for the missing fence, and drops the others.
    "v3 bad type": (
        "deepseek_v3",
        section(v3("f", "{}"), "\n", v3("g", "{}", kind="tool")),
        v3("g", "{}", kind="tool"),
        [("f", "{}")],
    ),
    "v3 no fence": (
        "deepseek_v3",
        section(f"{CALL_BEGIN}function{TOOL_SEP}f\n{{}}{CALL_END}"),
        f"{CALL_BEGIN}function{TOOL_SEP}f\n{{}}{CALL_END}",
        [],
    ),
    "v3 empty name": ("deepseek_v3", section(v3("", "{}")), v3("", "{}"), []),
    "v3 cut in name": (
        "deepseek_v3",
        CALLS_BEGIN + CALL_BEGIN + "function" + TOOL_SEP + "get_w",
        CALL_BEGIN + "function" + TOOL_SEP + "get_w",
        [],
    ),
    # A call whose closing fence, end tag or end is missing: a call as vLLM's stream gives it
    # (vLLM's whole text drops it).
    "v3 no closing fence": (
        "deepseek_v3",
        section(V3_OPEN[len(CALLS_BEGIN) :] + W + CALL_END),
        None,
        [WEATHER],
    ),
    "v3 cut after arguments": ("deepseek_v3", V3_OPEN + W, None, [WEATHER]),
    "v3 cut after fence": ("deepseek_v3", V3_OPEN + W + "\n```", None, [WEATHER]),
    "v3 no end tag before the next call": (
        "deepseek_v3",
        CALLS_BEGIN + CALL_BEGIN + "function" + TOOL_SEP + "f\n```json\n{}\n```" + v3("g", "{}"),
        None,
        [("f", "{}"), ("g", "{}")],
    ),
    # Cut off inside its arguments: vLLM's whole text drops the call's text; here it is
    # content. Streamed, it stays a call (see STREAMED below), as in vLLM's stream.
    "v3 cut in arguments": (
        "deepseek_v3",
        "Checking." + V3_OPEN + '{"city": "Par',
        "Checking." + V3_OPEN[len(CALLS_BEGIN) :] + '{"city": "Par',
        [],
    ),
    # V3.1 cases differ from vLLM where their V3 counterparts above say.
    "v31 plain": ("deepseek_v31", "Hello there.", "Hello there.", []),
    "v31 one": ("deepseek_v31", section(v31(*WEATHER)), None, [WEATHER]),
    "v31 content before": (
        "deepseek_v31",
        "Let me check.\n\n" + section(v31(*WEATHER)),
        "Let me check.\n\n",
        [WEATHER],
    ),
    "v31 whitespace before": ("deepseek_v31", " \n" + section(v31(*WEATHER)), None, [WEATHER]),
    "v31 two": (
        "deepseek_v31",
        section(v31(*WEATHER), v31("get_time", '{"tz": "UTC"}')),
        None,
        [WEATHER, ("get_time", '{"tz": "UTC"}')],
    ),
    "v31 three nested": (
        "deepseek_v31",
        "Sure." + section(v31("a", NESTED), v31("b", "{}"), v31("c", '{"x": "he said \\"hi\\""}')),
        "Sure.",
        [("a", NESTED), ("b", "{}"), ("c", '{"x": "he said \\"hi\\""}')],
    ),
    "v31 two on lines": (
        "deepseek_v31",
        section(v31("f", "{}"), "\n", v31("g", '{"a": 1}')),
        None,
        [("f", "{}"), ("g", '{"a": 1}')],
    ),
    "v31 space before end tag": (
        "deepseek_v31",
        section(v31("f", '{"a": 1} ')),
        None,
        [("f", '{"a": 1} ')],
    ),
    "v31 unicode": (
        "deepseek_v31",
        "温度？" + section(v31("f", '{"c": "北京😀"}')),
        "温度？",
        [("f", '{"c": "北京😀"}')],
    ),
    "v31 no section": ("deepseek_v31", v31(*WEATHER), v31(*WEATHER), []),
    "v31 text after": ("deepseek_v31", section(v31(*WEATHER)) + "\nDone!", "\nDone!", [WEATHER]),
    "v31 multiline arguments": (
        "deepseek_v31",
        section(v31("f", '{\n  "a": 1\n}')),
        None,
        [("f", '{\n  "a": 1\n}')],
    ),
    "v31 no separator": (
        "deepseek_v31",
        section(CALL_BEGIN + "f{}" + CALL_END),
        CALL_BEGIN + "f{}" + CALL_END,
        [],
    ),
    "v31 empty name": ("deepseek_v31", section(v31("", "{}")), v31("", "{}"), []),
    "v31 cut in name": (
        "deepseek_v31",
        CALLS_BEGIN + CALL_BEGIN + "get_w",
        CALL_BEGIN + "get_w",
        [],
    ),
    "v31 cut after arguments": ("deepseek_v31", V31_OPEN + W, None, [WEATHER]),
    # vLLM: whole, f's arguments run on through g's call; streamed, g's take the end tags.
    "v31 no end tag before the next call": (
        "deepseek_v31",
        CALLS_BEGIN + CALL_BEGIN + "f" + TOOL_SEP + "{}" + v31("g", "{}") + CALLS_END,
        None,
        [("f", "{}"), ("g", "{}")],
    ),
    "v31 cut in arguments": (
        "deepseek_v31",
        "Checking." + V31_OPEN + '{"city": "Par',
        "Checking." + V31_OPEN[len(CALLS_BEGIN) :] + '{"city": "Par',
        [],
    ),
}

# Where the stream differs from the whole text: a call whose header went out stays a call.
STREAMED: dict[str, tuple[str | None, Calls]] = {
    "v3 cut in arguments": ("Checking.", [("get_weather", '{"city": "Par')]),
    "v31 cut in arguments": ("Checking.", [("get_weather", '{"city": "Par')]),
}

# vLLM's deltas (its tokens, with the markers as single tokens) and its streamed result.
VLLM_TOKEN_DELTAS = [
    "L",
    "et",
    " m",
    "e",
    " c",
    "he",
    "ck",
    " the",
    " w",
    "ea",
    "ther",
    ".\n",
    "\n",
    CALLS_BEGIN,
    CALL_BEGIN,
    "f",
    "un",
    "ction",
    TOOL_SEP,
    "get",
    "_",
    "w",
    "ea",
    "ther",
    "\n",
    "`",
    "`",
    "`",
    "j",
    "s",
    "on",
    "\n",
    "{",
    '"',
    "c",
    "ity",
    '"',
    ":",
    ' "',
    "P",
    "a",
    "ri",
    "s",
    '"',
    ",",
    ' "',
    "un",
    "it",
    '"',
    ":",
    ' "',
    "ce",
    "l",
    "s",
    "i",
    "us",
    '"',
    "}",
    "\n",
    "`",
    "`",
    "`",
    CALL_END,
    CALLS_END,
]
VLLM_STREAMED = ("Let me check the weather.\n\n", [WEATHER])

_MARKERS = re.compile(
    "|".join(re.escape(m) for m in (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP))
)

_BLOCK_END = re.compile(
    "|".join(re.escape(m) for m in (CALL_END, CALL_BEGIN, CALLS_BEGIN, CALLS_END))
)
_NO_MATCH = ("",)


def _stream(streamer: ToolCallStreamer, pieces: Iterable[str]) -> list[Delta]:
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += streamer.feed(piece)
    return deltas + streamer.finish()


def _calls(parsed: ParsedToolCalls) -> tuple[str | None, Calls]:
    return parsed.content, [(call.name, call.arguments) for call in parsed.tool_calls]


def _token_like(text: str) -> list[str]:
    """Markers whole, the rest two characters at a time (as a tokenizer's deltas come)."""
    pieces: list[str] = []
    for i, part in enumerate(_MARKERS.split(text)):
        pieces += [part[j : j + 2] for j in range(0, len(part), 2)]
        if i < len(_MARKERS.findall(text)):
            pieces.append(_MARKERS.findall(text)[i])
    return pieces


def _splits(text: str) -> Iterable[list[str]]:
    """The other parsers' splits, and token-like pieces."""
    yield from text_splits(text)
    yield _token_like(text)


def test_registry_names_the_parsers_as_vllm_and_keeps_the_default_decoding() -> None:
    assert TOOL_PARSERS["deepseek_v3"] is DeepSeekV3ToolParser
    assert TOOL_PARSERS["deepseek_v31"] is DeepSeekV31ToolParser
    # The markers are added, non-special tokens of DeepSeek's tokenizers; vLLM's parsers
    # leave skip_special_tokens as the request has it.
    assert not DeepSeekV3ToolParser.keeps_special_tokens
    assert not DeepSeekV31ToolParser.keeps_special_tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_text_gives_vllms_content_and_calls(case: str) -> None:
    parser_name, text, content, calls = CASES[case]

    parsed = get_tool_parser(parser_name).parse(text)

    assert _calls(parsed) == (content, calls)
    assert parsed.tools_called == bool(calls)
    entries = [call.to_openai() for call in parsed.tool_calls]
    assert all(e["type"] == "function" and e["id"].startswith("call_") for e in entries)
    assert len({e["id"] for e in entries}) == len(entries)


@pytest.mark.parametrize("case", sorted(CASES))
def test_streaming_in_any_split_gives_the_same(case: str) -> None:
    parser_name, text, content, calls = CASES[case]
    expected = STREAMED.get(case, (content, calls))
    parser = get_tool_parser(parser_name)

    for pieces in _splits(text):
        streamer = parser.streamer()
        deltas = _stream(streamer, pieces)
        assert _calls(fold_deltas(deltas)) == expected, pieces
        assert streamer.tools_called == bool(expected[1])
        headers = [e for d in deltas for e in d.get("tool_calls", ()) if "id" in e]
        assert [e["index"] for e in headers] == list(range(len(expected[1])))
        assert all(e["type"] == "function" for e in headers)


def test_stream_of_vllms_token_deltas_gives_vllms_streamed_result() -> None:
    assert "".join(VLLM_TOKEN_DELTAS) == CASES["v3 content before"][1]
    streamer = get_tool_parser("deepseek_v3").streamer()

    assert _calls(fold_deltas(_stream(streamer, VLLM_TOKEN_DELTAS))) == VLLM_STREAMED


@pytest.mark.parametrize(
    ("parser_name", "pieces"),
    [
        ("deepseek_v3", [V3_OPEN[:-3], V3_OPEN[-3:] + '{"ci', 'ty": 1}\n`', "``", CALL_END]),
        ("deepseek_v31", [V31_OPEN[:-3], V31_OPEN[-3:] + '{"ci', 'ty": 1}', "", CALL_END]),
    ],
)
def test_stream_sends_a_header_then_argument_fragments(parser_name: str, pieces: list[str]) -> None:
    streamer = get_tool_parser(parser_name).streamer()

    deltas = [streamer.feed(piece) for piece in pieces]

    call_id = deltas[1][0]["tool_calls"][0]["id"]
    header = {
        "index": 0,
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert deltas == [
        [],
        [
            {"tool_calls": [header]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]},
        ],
        [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1}'}}]}],
        [],  # V3's closing fence is held until the end tag shows it is one
        [],
    ]
    assert streamer.feed(CALLS_END) == []
    assert streamer.finish() == []
    assert streamer.tools_called


@pytest.mark.parametrize("parser_name", ["deepseek_v3", "deepseek_v31"])
def test_stream_holds_back_a_possible_marker_and_releases_it_at_the_end(
    parser_name: str,
) -> None:
    streamer = get_tool_parser(parser_name).streamer()

    assert streamer.feed("Hi <｜tool") == [{"content": "Hi "}]
    assert streamer.feed("box｜> ok <｜tool▁calls") == [{"content": "<｜toolbox｜> ok "}]
    assert streamer.finish() == [{"content": "<｜tool▁calls"}]
    assert not streamer.tools_called


def test_stream_holds_whitespace_before_the_calls_and_drops_it_there() -> None:
    streamer = get_tool_parser("deepseek_v31").streamer()

    assert streamer.feed("\n\n") == []
    assert streamer.feed(CALLS_BEGIN + "\n") == []
    assert fold_deltas(_stream(streamer, [v31("f", "{}"), "\n", CALLS_END])).content is None


def test_stream_releases_whitespace_alone_at_the_end_as_content() -> None:
    streamer = get_tool_parser("deepseek_v3").streamer()

    assert streamer.feed(" \n") == []
    assert streamer.finish() == [{"content": " \n"}]


@pytest.mark.parametrize("parser_name", ["deepseek_v3", "deepseek_v31"])
def test_random_marker_soup_never_raises_and_streams_as_whole_where_no_call_is_cut(
    parser_name: str,
) -> None:
    rng = random.Random(7)
    pieces = [
        CALLS_BEGIN,
        CALLS_END,
        CALL_BEGIN,
        CALL_END,
        TOOL_SEP,
        "function",
        "f",
        "\n",
        "```json\n",
        "\n```",
        '{"a": 1}',
        "{",
        "}",
        '"',
        " ",
        "<｜",
        "x",
    ]
    parser = get_tool_parser(parser_name)
    for _ in range(300):
        parts = [rng.choice(pieces) for _ in range(rng.randint(0, 14))]
        text = "".join(parts)
        whole = _calls(parser.parse(text))
        # A call cut off (no end tag before the next marker or the end) may stream as a call.
        cut = any(
            (_BLOCK_END.search(text, m.end()) or _NO_MATCH)[0] != CALL_END
            for m in re.finditer(re.escape(CALL_BEGIN), text)
        )
        for chunks in (parts, list(text)):
            streamed = _calls(fold_deltas(_stream(parser.streamer(), chunks)))
            assert cut or streamed == whole, text


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31"])
def test_a_cut_off_call_nested_past_json_depth_is_no_crash(name: str) -> None:
    """A block cut off with arguments nested deeper than ``json`` parses (a looping model at
    max_tokens) is read like any cut-off block whose arguments are not whole JSON."""
    head = "function<｜tool▁sep｜>f\n```json\n" if name == "deepseek_v3" else "f<｜tool▁sep｜>"
    text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + head + "[" * 5000
    parsed = get_tool_parser(name).parse(text)
    assert not parsed.tool_calls and (parsed.content or "").endswith(head + "[" * 5000)
