"""Tool calls read out of generated text: whole, streamed in any split, and forced by a schema."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from typing import Any

import jsonschema
import pytest
from transformers import PreTrainedTokenizerFast

from cluster.api.forced_tool_calls import (
    NamedToolCallStreamer,
    RequiredToolCallStreamer,
    find_tool,
    named_tool_schema,
    parse_named_tool_call,
    parse_required_tool_calls,
    required_tools_schema,
)
from cluster.api.openai_payloads import ToolChoice
from cluster.api.replica_messages import StreamStart
from cluster.api.tool_calls import Delta, ParsedToolCalls, ToolCallStreamer, fold_deltas
from cluster.api.tool_parsers import TOOL_PARSERS, get_tool_parser
from engine.builtin import tiny_models
from tests.cluster.api.scripted_chat import scripted_chat

HERMES_TEXTS = {
    "one call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "content before a call": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        "</tool_call>"
    ),
    "two parallel calls": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    ),
    "escapes in strings": (
        '<tool_call>{"name": "say", "arguments": {"text": "a \\"}\\" b <tag>", '
        '"n": [1, {"x": null}]}}</tool_call>'
    ),
    "name after arguments": '<tool_call>{"arguments": {"q": 1}, "name": "find"}</tool_call>',
    "string arguments": '<tool_call>{"name": "find", "arguments": "{\\"q\\": 1}"}</tool_call>',
    "no arguments": '<tool_call>{"name": "now"}</tool_call>',
    "no end tag": '<tool_call>\n{"name": "now", "arguments": {}}\n',
    "content after a call": '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n\nDone.',
    "plain text": "The <b>river</b> is wide <tool and deep.\n",
    "malformed json": '<tool_call>{"name": "now" "arguments": {}}</tool_call> rest',
    "no name": 'Hi <tool_call>{"arguments": {}}</tool_call> there',
    "non-object arguments": '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',
    "malformed then good": (
        "<tool_call>oops</tool_call> <tool_call>\n"
        '{"name": "now", "arguments": {"a": "\\u00e9"}}\n</tool_call>'
    ),
    "empty block": "x <tool_call></tool_call> y",
    "end tag inside a string": (
        '<tool_call>{"name": "f", "arguments": {"s": "</tool_call> <tool_call>"}}</tool_call>'
    ),
    "plain string arguments": '<tool_call>{"name": "f", "arguments": "hello world"}</tool_call>',
    "content on both sides": (
        'Let me check.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\nDone checking.'
    ),
    "a call inside a code fence": (
        'Example:\n```\n<tool_call>{"name": "now", "arguments": {}}</tool_call>\n```\nend'
    ),
    "junk after the object": '<tool_call>{"name": "f", "arguments": {"x": 1}} junk</tool_call>',
    "text after a block with no end tag": (
        '<tool_call>{"name": "now", "arguments": {}}\nand then some text'
    ),
}
LLAMA3_TEXTS = {
    "one call": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "python tag": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "two calls": '{"name": "f", "parameters": {"a": "x;y"}}; {"name": "g", "arguments": {}}',
    "escapes in strings": ' {"name": "say", "parameters": {"text": "a \\"}\\" b"}}\n',
    "plain text": "The river is wide.",
    "json that is no call": '{"answer": 42}',
    "malformed json": '{"name": "f" "parameters": {"a": 1}}',
    "string parameters": '{"name": "f", "parameters": "not json"}',
    "text after a call": '{"name": "f", "parameters": {"x": 1}} hope that helps',
    "calls separated by a newline": (
        '{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}}'
    ),
    "cut off inside a later call": '{"name": "a", "parameters": {}}; {"name": "b", "par',
}
# GLM-4.5's format as its chat template writes a call (one pair per line, non-string values as
# JSON), and the ways a block can go wrong.
GLM_TEXTS = {
    "one call": (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    ),
    "reasoning's answer then two calls": (
        "I will look both up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Oslo</arg_value>\n</tool_call>\n<tool_call>get_time\n"
        "<arg_key>zone</arg_key>\n<arg_value>Europe/Oslo</arg_value>\n</tool_call>"
    ),
    "json values": (
        '<tool_call>plan\n<arg_key>steps</arg_key>\n<arg_value>["a", "b"]</arg_value>\n'
        '<arg_key>opts</arg_key>\n<arg_value>{"fast": true, "n": null}</arg_value>\n'
        '<arg_key>note</arg_key>\n<arg_value>a <b> & "c"\nd</arg_value>\n</tool_call>'
    ),
    "no arguments": "<tool_call>now\n</tool_call>",
    "no newline after the name": (
        "<tool_call>now<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>"
    ),
    "no end tag": "<tool_call>now\n<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n",
    "content after a call": "<tool_call>now\n</tool_call>\n\nDone.",
    "plain text": "a <b>river</b> <tool and <arg_key> deep\n",
    "no name": "Hi <tool_call>\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call> x",
    "text between pairs": (
        "<tool_call>f\njunk<arg_key>a</arg_key><arg_value>1</arg_value></tool_call> rest"
    ),
    "cut inside a pair": "so <tool_call>f\n<arg_key>a</arg_key>\n<arg_val",
    "malformed then good": "<tool_call>\n</tool_call> <tool_call>now\n</tool_call>",
    "text after a pair with no end tag": (
        "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\nand then some text"
    ),
    "junk after a pair": (
        "<tool_call>now\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\njunk</tool_call> x"
    ),
    "cut inside a second pair": (
        "<tool_call>now\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b</arg"
    ),
    "content on both sides": (
        "Checking now.\n<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"
        "</tool_call>\nAfter."
    ),
}
# Arguments that turn out malformed only once they end: a stream that announced the call in an
# earlier piece cannot take it back.
BROKEN_ARGUMENTS = {
    "hermes": 'Text <tool_call>{"name": "now", "arguments": {bad json}}</tool_call> after',
    "llama3_json": '{"name": "now", "parameters": {"a": }}',
}


def _stream(streamer: ToolCallStreamer, pieces: Iterable[str]) -> list[Delta]:
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += streamer.feed(piece)
    return deltas + streamer.finish()


def _calls(parsed: ParsedToolCalls) -> tuple[str | None, list[tuple[str, str]]]:
    return parsed.content, [(call.name, call.arguments) for call in parsed.tool_calls]


def text_splits(text: str) -> Iterable[list[str]]:
    """Every split into two pieces, one character at a time, and seeded random chunks."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(0)
    for _ in range(20):
        pieces, start = [], 0
        while start < len(text):
            end = start + rng.randint(1, 8)
            pieces.append(text[start:end])
            start = end
        yield pieces


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "glm45"])
def test_registry_builds_each_parser_by_name(parser_name: str) -> None:
    assert type(get_tool_parser(parser_name)) is TOOL_PARSERS[parser_name]


def test_unknown_parser_name_raises_value_error_listing_valid_names() -> None:
    with pytest.raises(ValueError, match=r"'mistral'.*glm45, hermes, kimi_k2, llama3_json"):
        get_tool_parser("mistral")


# hermes, whole text


def test_hermes_separates_content_from_a_call() -> None:
    parsed = get_tool_parser("hermes").parse(HERMES_TEXTS["content before a call"])

    assert _calls(parsed) == ("Let me check.", [("get_weather", '{"city": "Oslo"}')])
    assert parsed.tools_called


def test_hermes_reads_two_parallel_calls_with_no_content() -> None:
    parsed = get_tool_parser("hermes").parse(HERMES_TEXTS["two parallel calls"])

    assert _calls(parsed) == (None, [("get_weather", '{"city": "Oslo"}'), ("now", "{}")])
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id
    assert all(call.id.startswith("call_") and len(call.id) == 29 for call in parsed.tool_calls)


def test_hermes_keeps_arguments_as_written_including_escaped_quotes_and_braces() -> None:
    parsed = get_tool_parser("hermes").parse(HERMES_TEXTS["escapes in strings"])

    assert _calls(parsed) == (
        None,
        [("say", '{"text": "a \\"}\\" b <tag>", "n": [1, {"x": null}]}')],
    )


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("name after arguments", ("find", '{"q": 1}')),
        # A string stays a JSON string, even one that holds an object, as vLLM's json.dumps.
        ("string arguments", ("find", '"{\\"q\\": 1}"')),
        ("no arguments", ("now", "{}")),
        ("no end tag", ("now", "{}")),
    ],
)
def test_hermes_reads_the_call_variants(case: str, expected: tuple[str, str]) -> None:
    assert _calls(get_tool_parser("hermes").parse(HERMES_TEXTS[case])) == (None, [expected])


def test_hermes_whitespace_next_to_a_call_is_not_content() -> None:
    parsed = get_tool_parser("hermes").parse(HERMES_TEXTS["content after a call"])

    assert _calls(parsed) == ("Done.", [("now", "{}")])


@pytest.mark.parametrize(
    "case", ["plain text", "malformed json", "no name", "non-object arguments", "empty block"]
)
def test_hermes_text_without_a_wellformed_call_is_all_content(case: str) -> None:
    parsed = get_tool_parser("hermes").parse(HERMES_TEXTS[case])

    assert _calls(parsed) == (HERMES_TEXTS[case], [])
    assert not parsed.tools_called


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("end tag inside a string", (None, [("f", '{"s": "</tool_call> <tool_call>"}')])),
        ("plain string arguments", (None, [("f", '"hello world"')])),
        ("content on both sides", ("Let me check.\n\nDone checking.", [("now", "{}")])),
        ("a call inside a code fence", ("Example:\n```\n\n```\nend", [("now", "{}")])),
        ("junk after the object", (None, [("f", '{"x": 1}')])),
        ("text after a block with no end tag", ("and then some text", [("now", "{}")])),
    ],
)
def test_hermes_whole_text_reads_blocks_as_the_stream_does(
    case: str, expected: tuple[str | None, list[tuple[str, str]]]
) -> None:
    assert _calls(get_tool_parser("hermes").parse(HERMES_TEXTS[case])) == expected


def test_hermes_never_reports_a_call_whose_arguments_are_not_json() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>'

    assert _calls(get_tool_parser("hermes").parse(text)) == (text, [])


def test_hermes_malformed_block_stays_content_beside_a_good_call() -> None:
    parsed = get_tool_parser("hermes").parse(HERMES_TEXTS["malformed then good"])

    assert _calls(parsed) == ("<tool_call>oops</tool_call>", [("now", '{"a": "\\u00e9"}')])


# llama3_json, whole text


@pytest.mark.parametrize("case", ["one call", "python tag"])
def test_llama3_reads_a_call_with_parameters(case: str) -> None:
    parsed = get_tool_parser("llama3_json").parse(LLAMA3_TEXTS[case])

    assert _calls(parsed) == (None, [("get_weather", '{"city": "Oslo"}')])


def test_llama3_reads_calls_separated_by_semicolons_with_either_key() -> None:
    parsed = get_tool_parser("llama3_json").parse(LLAMA3_TEXTS["two calls"])

    assert _calls(parsed) == (None, [("f", '{"a": "x;y"}'), ("g", "{}")])


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("string parameters", (None, [("f", '"not json"')])),
        ("text after a call", ("hope that helps", [("f", '{"x": 1}')])),
        ("calls separated by a newline", (None, [("a", "{}"), ("b", "{}")])),
        ("cut off inside a later call", ('{"name": "b", "par', [("a", "{}")])),
    ],
)
def test_llama3_whole_text_reads_calls_as_the_stream_does(
    case: str, expected: tuple[str | None, list[tuple[str, str]]]
) -> None:
    assert _calls(get_tool_parser("llama3_json").parse(LLAMA3_TEXTS[case])) == expected


def test_llama3_keeps_escaped_quotes_and_braces() -> None:
    parsed = get_tool_parser("llama3_json").parse(LLAMA3_TEXTS["escapes in strings"])

    assert _calls(parsed) == (None, [("say", '{"text": "a \\"}\\" b"}')])


@pytest.mark.parametrize("case", ["plain text", "json that is no call", "malformed json"])
def test_llama3_text_that_is_no_call_is_all_content(case: str) -> None:
    parsed = get_tool_parser("llama3_json").parse(LLAMA3_TEXTS[case])

    assert _calls(parsed) == (LLAMA3_TEXTS[case], [])


# streaming


@pytest.mark.parametrize(
    ("parser_name", "case"),
    [("hermes", case) for case in HERMES_TEXTS]
    + [("llama3_json", case) for case in LLAMA3_TEXTS]
    + [("glm45", case) for case in GLM_TEXTS],
)
def test_streaming_in_any_split_gives_the_whole_text_result(parser_name: str, case: str) -> None:
    parser = get_tool_parser(parser_name)
    texts = {"hermes": HERMES_TEXTS, "llama3_json": LLAMA3_TEXTS, "glm45": GLM_TEXTS}
    text = texts[parser_name][case]
    expected = _calls(parser.parse(text))

    for pieces in text_splits(text):
        streamer = parser.streamer()
        streamed = fold_deltas(_stream(streamer, pieces))
        assert _calls(streamed) == expected, pieces
        assert streamer.tools_called == bool(expected[1])


@pytest.mark.parametrize(
    ("parser_name", "text"),
    [("hermes", text) for text in HERMES_TEXTS.values()]
    + [("llama3_json", text) for text in LLAMA3_TEXTS.values()]
    + [("glm45", text) for text in GLM_TEXTS.values()]
    + list(BROKEN_ARGUMENTS.items()),
)
def test_whole_text_calls_have_json_arguments(parser_name: str, text: str) -> None:
    for call in get_tool_parser(parser_name).parse(text).tool_calls:
        json.loads(call.arguments)


@pytest.mark.parametrize("parser_name", sorted(BROKEN_ARGUMENTS))
def test_broken_arguments_are_content_whole_and_streamed_in_the_piece_that_breaks_them(
    parser_name: str,
) -> None:
    parser = get_tool_parser(parser_name)
    text = BROKEN_ARGUMENTS[parser_name]
    cut = text.index("{", text.index("rguments" if parser_name == "hermes" else "parameters"))

    assert _calls(parser.parse(text)) == (text, [])
    assert _calls(fold_deltas(_stream(parser.streamer(), [text]))) == (text, [])
    assert _calls(fold_deltas(_stream(parser.streamer(), [text[:cut], text[cut:]]))) == (
        text,
        [],
    )


@pytest.mark.parametrize("parser_name", sorted(BROKEN_ARGUMENTS))
def test_broken_arguments_stay_a_call_where_an_earlier_piece_announced_it(
    parser_name: str,
) -> None:
    parser = get_tool_parser(parser_name)
    text = BROKEN_ARGUMENTS[parser_name]
    cut = text.index("{", text.index("rguments" if parser_name == "hermes" else "parameters"))

    streamed = fold_deltas(_stream(parser.streamer(), [text[: cut + 1], text[cut + 1 :]]))

    if parser_name == "hermes":
        assert _calls(streamed) == ("Text  after", [("now", "{bad json}")])
    else:
        # No end tag bounds a llama3 call: what follows the break is content.
        assert _calls(streamed) == ("}", [("now", '{"a": }')])


def test_hermes_stream_holds_back_a_possible_tag_until_it_is_decided() -> None:
    streamer = get_tool_parser("hermes").streamer()

    assert streamer.feed("Hi <tool") == [{"content": "Hi"}]
    assert streamer.feed("box") == [{"content": " <toolbox"}]
    assert streamer.feed(" <tool") == []
    assert streamer.finish() == [{"content": " <tool"}]


def test_hermes_stream_sends_a_header_then_argument_fragments() -> None:
    streamer = get_tool_parser("hermes").streamer()
    pieces = ["<tool_call>\n", '{"name": "get_', 'weather", "arguments": {"ci', 'ty": "Oslo"}}']

    deltas = [streamer.feed(piece) for piece in pieces] + [streamer.feed("\n</tool_call>")]

    call_id = deltas[2][0]["tool_calls"][0]["id"]
    assert deltas == [
        [],
        [],
        [
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            },
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]},
        ],
        [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}],
        [],
    ]
    assert streamer.finish() == []
    assert streamer.tools_called


def test_streamed_chat_logprobs_of_held_back_text_add_up_to_the_whole() -> None:
    """Tokens whose text the streamer holds back (a tag that may open a call) send their
    logprobs in a chunk with an empty delta, as vLLM does."""
    text = HERMES_TEXTS["content before a call"]
    tokens = [text[i : i + 4] for i in range(0, len(text), 4)]
    start, tools = StreamStart(3, tool_call_parser="hermes"), ToolChoice("auto")
    whole, _ = scripted_chat(start, tokens, stream=False, tools=tools, logprobs=True)
    expected = whole.whole()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in expected] == tokens
    _, chunks = scripted_chat(start, tokens, stream=True, tools=tools, logprobs=True)
    assert [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]] == expected
    assert {} in [c["delta"] for c in chunks]


def test_hermes_stream_numbers_parallel_calls_from_zero() -> None:
    deltas = _stream(get_tool_parser("hermes").streamer(), [HERMES_TEXTS["two parallel calls"]])

    headers = [d["tool_calls"][0] for d in deltas if "id" in d.get("tool_calls", [{}])[0]]
    assert [(h["index"], h["function"]["name"]) for h in headers] == [
        (0, "get_weather"),
        (1, "now"),
    ]


def test_llama3_stream_of_plain_text_is_content_from_the_first_character() -> None:
    streamer = get_tool_parser("llama3_json").streamer()

    assert streamer.feed("  The") == [{"content": "  The"}]
    assert streamer.feed(" river") == [{"content": " river"}]


# forced calls

NAMED_OUTPUTS = [
    '{"city": "Oslo", "note": "a \\"}\\" b"}',
    '\n  {\n  "city" : "Oslo",\n  "days": [1, 2]\n}\n',
]
REQUIRED_OUTPUTS = [
    '[{"name":"get_weather","parameters":{"city":"a \\"}]\\" b"}},{"name":"now","parameters":{}}]',
    '[\n  {"name": "get_weather", "parameters": {"city": "Oslo"}} ,\n'
    '  { "name" : "now" , "parameters" : { } }\n]\n',
]


@pytest.mark.parametrize("text", NAMED_OUTPUTS)
def test_named_call_is_the_whole_output_as_arguments(text: str) -> None:
    parsed = parse_named_tool_call("get_weather", text)

    assert _calls(parsed) == (None, [("get_weather", text.strip())])


@pytest.mark.parametrize("text", NAMED_OUTPUTS)
def test_named_call_streamed_in_any_split_gives_the_whole_output_result(text: str) -> None:
    expected = _calls(parse_named_tool_call("get_weather", text))

    for pieces in text_splits(text):
        streamed = fold_deltas(_stream(NamedToolCallStreamer("get_weather"), pieces))
        assert _calls(streamed) == expected, pieces


def test_named_call_streams_its_header_first_and_arguments_as_they_arrive() -> None:
    streamer = NamedToolCallStreamer("get_weather")

    first = streamer.feed('{"city": ')

    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1:] == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}]
    assert streamer.feed('"Oslo"}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}
    ]
    assert streamer.tools_called


def test_required_calls_are_the_array_elements() -> None:
    compact, spaced = (parse_required_tool_calls(text) for text in REQUIRED_OUTPUTS)

    assert _calls(compact) == (
        None,
        [("get_weather", '{"city":"a \\"}]\\" b"}'), ("now", "{}")],
    )
    assert _calls(spaced) == (None, [("get_weather", '{"city": "Oslo"}'), ("now", "{ }")])


@pytest.mark.parametrize("text", REQUIRED_OUTPUTS)
def test_required_calls_streamed_in_any_split_give_the_whole_output_result(text: str) -> None:
    expected = _calls(parse_required_tool_calls(text))

    for pieces in text_splits(text):
        streamer = RequiredToolCallStreamer()
        assert _calls(fold_deltas(_stream(streamer, pieces))) == expected, pieces
        assert streamer.tools_called


def test_required_call_header_goes_out_once_its_name_is_whole() -> None:
    streamer = RequiredToolCallStreamer()

    assert streamer.feed('[{"name": "get_wea') == []
    header = streamer.feed('ther", ')
    fragment = streamer.feed('"parameters": {"ci')

    assert header[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert fragment == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}]


# schemas

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NOW = {"name": "now"}  # a bare function dict with no parameters


def _valid(schema: dict[str, Any], instance: Any) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


@pytest.mark.parametrize(
    ("instance", "valid"),
    [
        ([{"name": "get_weather", "parameters": {"city": "Oslo"}}], True),
        ([{"name": "now", "parameters": {}}, {"name": "now", "parameters": {"x": 1}}], True),
        ([], False),
        ([{"name": "get_weather", "parameters": {}}], False),
        ([{"name": "now", "parameters": []}], False),
        ([{"name": "lookup", "parameters": {}}], False),
        ([{"name": "now", "parameters": {}, "extra": 1}], False),
        ([{"name": "now"}], False),
    ],
)  # fmt: skip
def test_required_tools_schema_accepts_exactly_calls_of_the_tools(
    instance: Any, valid: bool
) -> None:
    assert _valid(required_tools_schema([WEATHER, NOW]), instance) is valid


def test_required_tools_schema_allows_one_call_without_parallel_tool_calls() -> None:
    schema = required_tools_schema([WEATHER, NOW], parallel_tool_calls=False)
    one = [{"name": "now", "parameters": {}}]

    assert _valid(schema, one)
    assert not _valid(schema, one + one)


def test_required_tools_schema_accepts_what_the_required_streamer_reads() -> None:
    schema = required_tools_schema([WEATHER, NOW])

    for text in REQUIRED_OUTPUTS:
        calls = parse_required_tool_calls(text).tool_calls
        instance = [{"name": c.name, "parameters": json.loads(c.arguments)} for c in calls]
        assert _valid(schema, instance)


def test_named_tool_schema_is_the_tools_parameters_or_the_empty_object() -> None:
    from xgrammar.testing import _is_grammar_accept_string

    from engine.core.structured_output import _parse

    assert named_tool_schema(WEATHER) == WEATHER["function"]["parameters"]
    # No parameters: vLLM's schema, whose grammar takes {} and no invented argument.
    assert named_tool_schema(NOW) == {"type": "object", "properties": {}}
    grammar = _parse("json", json.dumps(named_tool_schema(NOW)), any_whitespace=True)
    assert _is_grammar_accept_string(grammar, "{}")
    assert not _is_grammar_accept_string(grammar, '{"tz": "UTC"}')
    assert _valid(named_tool_schema(WEATHER), {"city": "Oslo"})
    assert not _valid(named_tool_schema(WEATHER), {"town": "Oslo"})
    assert not _valid(named_tool_schema(NOW), [])


def test_find_tool_is_the_tool_of_that_name() -> None:
    assert find_tool([WEATHER, NOW], "now") is NOW


# the tiny models' template and their default parser agree


def test_tiny_models_parser_reads_back_the_tool_calls_their_template_renders() -> None:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tiny_models.build_tokenizer(),
        bos_token=tiny_models.BOS_TOKEN,
        chat_template=tiny_models.CHAT_TEMPLATE,
    )
    calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]
    prompt = [{"role": "user", "content": "Weather?"}]
    messages = prompt + [{"role": "assistant", "content": "Checking.", "tool_calls": calls}]
    before = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    generated = rendered[len(before) :].removesuffix("<|im_end|>\n")

    parsed = get_tool_parser(tiny_models.DEFAULT_TOOL_CALL_PARSER).parse(generated)

    assert _calls(parsed) == ("Checking.", [("get_weather", '{"city": "Oslo"}'), ("now", "{}")])


# ---- GLM-4.5 ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("one call", (None, [("get_weather", '{"city": "Beijing", "days": 3}')])),
        (
            "reasoning's answer then two calls",
            (
                "I will look both up.",
                [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "Europe/Oslo"}')],
            ),
        ),
        (
            "json values",
            (
                None,
                [("plan", '{"steps": ["a", "b"], "opts": {"fast": true, "n": null}, '
                          '"note": "a <b> & \\"c\\"\\nd"}')],
            ),
        ),
        ("no arguments", (None, [("now", "{}")])),
        ("no newline after the name", (None, [("now", '{"tz": "UTC"}')])),
        ("no end tag", (None, [("now", '{"tz": "UTC"}')])),
        ("content after a call", ("Done.", [("now", "{}")])),
        ("malformed then good", ("<tool_call>\n</tool_call>", [("now", "{}")])),
        ("text after a pair with no end tag", ("and then some text", [("f", '{"a": 1}')])),
        ("junk after a pair", ("x", [("now", '{"a": 1}')])),
        ("cut inside a second pair", (None, [("now", '{"a": 1}')])),
        ("content on both sides", ("Checking now.\n\nAfter.", [("f", '{"a": 1}')])),
    ],
)  # fmt: skip
def test_glm45_reads_calls_into_json_arguments(
    case: str, expected: tuple[str | None, list[tuple[str, str]]]
) -> None:
    parsed = get_tool_parser("glm45").parse(GLM_TEXTS[case])
    assert _calls(parsed) == expected
    for call in parsed.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(
    "case", ["plain text", "no name", "text between pairs", "cut inside a pair"]
)
def test_glm45_text_without_a_wellformed_call_is_all_content(case: str) -> None:
    assert _calls(get_tool_parser("glm45").parse(GLM_TEXTS[case])) == (GLM_TEXTS[case], [])


def test_glm45_takes_a_string_parameter_as_written_and_reads_the_others_as_json() -> None:
    # 0123 is no JSON number, so it stays a string either way; true becomes a bool untyped.
    text = (
        "<tool_call>lookup\n<arg_key>zip</arg_key>\n<arg_value>0123</arg_value>\n"
        "<arg_key>limit</arg_key>\n<arg_value>10</arg_value>\n"
        "<arg_key>word</arg_key>\n<arg_value>true</arg_value>\n</tool_call>"
    )
    string = {"type": "string"}
    typed = get_tool_parser("glm45", {("lookup", "zip"): string, ("lookup", "word"): string})
    untyped = get_tool_parser("glm45")
    assert json.loads(typed.parse(text).tool_calls[0].arguments) == {
        "zip": "0123", "limit": 10, "word": "true"
    }  # fmt: skip
    assert json.loads(untyped.parse(text).tool_calls[0].arguments) == {
        "zip": "0123", "limit": 10, "word": True
    }  # fmt: skip


def test_glm45_reads_true_and_false_as_written_in_python_for_a_declared_boolean() -> None:
    text = (
        "<tool_call>run\n<arg_key>flag</arg_key>\n<arg_value>True</arg_value>\n"
        "<arg_key>note</arg_key>\n<arg_value>False</arg_value>\n</tool_call>"
    )
    parser = get_tool_parser("glm45", {("run", "flag"): {"type": "boolean"}})
    expected = {"flag": True, "note": "False"}  # only where the tool declares a boolean
    assert json.loads(parser.parse(text).tool_calls[0].arguments) == expected
    streamed = fold_deltas(
        _stream(parser.streamer(), [text[i : i + 5] for i in range(0, len(text), 5)])
    )
    assert json.loads(streamed.tool_calls[0].arguments) == expected


def test_glm45_stream_announces_a_call_with_its_first_pair_and_sends_each_pair_whole() -> None:
    streamer = get_tool_parser("glm45").streamer()
    text = GLM_TEXTS["one call"]
    first_pair_end = text.index("</arg_value>") + len("</arg_value>")
    assert streamer.feed(text[: first_pair_end - 1]) == []
    (header, first) = streamer.feed(text[first_pair_end - 1 : first_pair_end])
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first["tool_calls"][0]["function"]["arguments"] == '{"city": "Beijing"'
    rest = streamer.feed(text[first_pair_end:]) + streamer.finish()
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in rest) == ', "days": 3}'


DEEP = "[" * 3000 + "]" * 3000  # nested past json's recursion limit


@pytest.mark.parametrize(
    ("parser_name", "text"),
    [("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + DEEP + "}}</tool_call>"),
     ("llama3_json", '{"name": "f", "parameters": {"a": ' + DEEP + "}}"),
     ("glm45", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>" + DEEP + "</arg_value>\n"
               "</tool_call>")],
)  # fmt: skip
def test_arguments_nested_past_jsons_depth_are_not_an_exception(
    parser_name: str, text: str
) -> None:
    """Such text is no call the client could decode (a RecursionError in ``json.loads``): the
    whole text is content (glm45: a string value), and neither way is a failed response."""
    parser = get_tool_parser(parser_name)
    if parser_name == "glm45":
        assert _calls(parser.parse(text)) == (None, [("f", json.dumps({"a": DEEP}))])
    else:
        assert _calls(parser.parse(text)) == (text, [])
    # A stream that announced the call before its arguments ended keeps it (BROKEN_ARGUMENTS).
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    streamed = fold_deltas(_stream(parser.streamer(), pieces))
    assert {call.name for call in streamed.tool_calls} <= {"f"}
