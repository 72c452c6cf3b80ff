"""gpt-oss's harmony output read by channel (``cluster.api.harmony``, the ``openai`` tool parser
and the ``openai_gptoss`` reasoning parser), on the transcripts of OpenAI's harmony
specification (openai/harmony ``docs/format.md``), whole and streamed in any split; chat
responses built from them (``Completion``); and ``LLMServer`` over ``builtin:tiny-gpt-oss``,
made to write a harmony transcript by a grammar over its special tokens."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.api.harmony import Piece, read_harmony
from cluster.api.openai_models import ChatCompletionRequest
from cluster.api.openai_payloads import ToolChoice, chat_payload
from cluster.api.openai_responses import Completion
from cluster.api.reasoning_parsers import get_reasoning_parser, reasoning_front
from cluster.api.replica_messages import GenerateRequest, StreamError, StreamStart
from cluster.api.tool_parsers import HarmonyStreamer, get_tool_parser, parse_harmony
from cluster.serving.llm_server import LLMServer
from cluster.serving.request_inputs import chat_prompt_ids
from engine import ConfigError
from engine.builtin.tiny_harmony import HARMONY_TOKEN_IDS
from tests.cluster.api.scripted_chat import scripted_chat

# The spec's outputs ("Chat conversation format", "Receiving tool calls", "Preambles"), as
# the engine hands them over: the stop token that ended them (<|return|>, <|call|>) is no text.
SPEC_ANSWER = (
    '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide '
    "answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4."
)
SPEC_CALL = (
    "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant"
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"location":"San Francisco"}'
)
SPEC_PREAMBLE = (
    "<|channel|>analysis<|message|>{long chain of thought}<|end|><|start|>assistant<|channel|>"
    "commentary<|message|>**Action plan**:\n1. Generate an HTML file\n2. Generate a JavaScript "
    "for the Node.js server\n3. Start the server\n---\nWill start executing the plan step by "
    "step<|end|><|start|>assistant<|channel|>commentary to=functions.generate_file<|constrain|>"
    'json<|message|>{"template": "basic_html", "path": "index.html"}'
)
# "The recipient might be defined in the role or channel section of the header."
ROLE_RECIPIENT = (
    "<|channel|>analysis<|message|>Need Tokyo.<|end|><|start|>assistant to=functions.get_weather"
    '<|channel|>commentary json<|message|>{"location": "Tokyo"}'
)
FIRST_ROLE_RECIPIENT = " to=functions.get_location<|channel|>commentary json<|message|>{}"
PLAIN_PREAMBLE = "<|channel|>commentary<|message|>Checking.<|end|>"
# gpt-oss sometimes leaves out the "functions." of a call's recipient: still the call (vLLM's).
BARE_RECIPIENT = (
    "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary "
    'to=get_weather <|constrain|>json<|message|>{"city":"P"}'
)
# "functions." with no name calls nothing: the message is dropped (vLLM's).
NO_FUNCTION_NAME = (
    "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary "
    "to=functions. <|constrain|>json<|message|>{}"
)

EXPECTED: dict[str, tuple[str | None, str | None, list[tuple[str, str]]]] = {
    SPEC_ANSWER: ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.',
                  "2 + 2 = 4.", []),
    SPEC_CALL: ("Need to use function get_weather.", None,
                [("get_weather", '{"location":"San Francisco"}')]),
    SPEC_PREAMBLE: ("{long chain of thought}", "**Action plan**:\n1. Generate an HTML file\n2. "
                    "Generate a JavaScript for the Node.js server\n3. Start the server\n---\n"
                    "Will start executing the plan step by step",
                    [("generate_file", '{"template": "basic_html", "path": "index.html"}')]),
    ROLE_RECIPIENT: ("Need Tokyo.", None, [("get_weather", '{"location": "Tokyo"}')]),
    FIRST_ROLE_RECIPIENT: (None, None, [("get_location", "{}")]),
    PLAIN_PREAMBLE + "<|start|>assistant<|channel|>final<|message|>Done.": (
        None, "Checking.Done.", []),
    BARE_RECIPIENT: ("x", None, [("get_weather", '{"city":"P"}')]),
    NO_FUNCTION_NAME: ("x", None, []),
}  # fmt: skip
TRANSCRIPTS = list(EXPECTED)
WITH_STOP = {SPEC_ANSWER: SPEC_ANSWER + "<|return|>", SPEC_CALL: SPEC_CALL + "<|call|>"}


def _summary(text: str, read_calls: bool = True) -> tuple[Any, Any, list[tuple[str, str]]]:
    reasoning, parsed = parse_harmony(text, read_calls)
    return reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def _splits(text: str) -> Iterator[list[str]]:
    """The text a character at a time, in odd sizes, and cut in two at every place."""
    yield list(text)
    sizes, pieces, at = [2, 3, 5, 7, 11], [], 0
    while at < len(text):
        size = sizes[len(pieces) % len(sizes)]
        pieces.append(text[at : at + size])
        at += size
    yield pieces
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def _fold_stream(pieces: list[str], read_calls: bool = True) -> tuple[Any, Any, list[Any]]:
    streamer = HarmonyStreamer(reasoning=True, read_calls=read_calls)
    deltas = [d for piece in pieces for d in streamer.feed(piece)] + streamer.finish()
    assert not any("<|" in json.dumps(d) for d in deltas), deltas  # no channel syntax
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
    content = "".join(d.get("content") or "" for d in deltas) or None
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for entry in delta.get("tool_calls", ()):
            call = calls.setdefault(entry["index"], ["", ""])
            call[0] += entry["function"].get("name", "")
            call[1] += entry["function"]["arguments"]
    return reasoning, content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("text", TRANSCRIPTS)
def test_spec_transcripts_by_channel(text: str) -> None:
    assert _summary(text) == EXPECTED[text]


@pytest.mark.parametrize("text", list(WITH_STOP))
def test_a_stop_token_in_the_text_ends_the_message_too(text: str) -> None:
    assert _summary(WITH_STOP[text]) == EXPECTED[text]


@pytest.mark.parametrize("text", TRANSCRIPTS + list(WITH_STOP.values()))
def test_any_split_of_the_stream_adds_up_to_the_whole(text: str) -> None:
    whole = _summary(text)
    for pieces in _splits(text):
        assert _fold_stream(pieces) == whole, pieces


def test_a_possible_special_token_is_held_back_until_decided() -> None:
    reader_text = "<|channel|>final<|message|>Hi <|re"
    streamer = HarmonyStreamer()
    assert streamer.feed(reader_text) == [{"content": "Hi "}]
    assert streamer.feed("d") == [{"content": "<|red"}]  # no token after all
    assert streamer.feed(" <|en") == [{"content": " "}]
    assert streamer.feed("d|>") == [] and streamer.finish() == []


def test_a_call_header_comes_once_the_header_is_whole() -> None:
    streamer = HarmonyStreamer()
    assert streamer.feed("<|channel|>commentary to=functions.get_wea") == []
    deltas = streamer.feed("ther <|constrain|>json<|message|>{")
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1]["tool_calls"][0] == {"index": 0, "function": {"arguments": "{"}}
    assert streamer.tools_called


def test_without_tools_a_call_is_content() -> None:
    """A chat without tools (or tool_choice none) reads no calls: their text is content."""
    assert _summary(SPEC_CALL, read_calls=False) == (
        "Need to use function get_weather.", '{"location":"San Francisco"}', [])  # fmt: skip


def test_output_that_is_no_harmony_is_content() -> None:
    """A grammar forced JSON from the first token (response_format on gpt-oss)."""
    text = '{"answer": 4}'
    assert _summary(text) == (None, text, [])
    assert _fold_stream(list(text)) == (None, text, [])
    assert read_harmony("  ") == []


def test_other_recipients_and_roles_are_dropped() -> None:
    """Built-in tools (none is offered), the assistant itself, another role."""
    text = (
        "<|channel|>commentary to=python<|message|>print(1)<|end|>"
        "<|start|>assistant<|channel|>commentary to=browser.search<|message|>{}<|end|>"
        "<|start|>assistant<|channel|>commentary to=container.exec<|message|>{}<|end|>"
        "<|start|>assistant<|channel|>commentary to=assistant<|message|>hm<|end|>"
        "<|start|>functions.f to=assistant<|channel|>commentary<|message|>{}<|end|>"
        "<|start|>assistant<|channel|>final<|message|>ok"
    )
    assert read_harmony(text) == [Piece("content", "ok")]


def test_a_header_cut_off_is_no_message() -> None:
    assert _summary("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|chan") == (
        "hm",
        None,
        [],
    )


def test_the_openai_tool_parser_leaves_the_analysis_out() -> None:
    parsed = get_tool_parser("openai").parse(SPEC_PREAMBLE)
    assert parsed.content == EXPECTED[SPEC_PREAMBLE][1]
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == EXPECTED[SPEC_PREAMBLE][2]


def test_the_openai_gptoss_reasoning_parser_splits_analysis_from_final() -> None:
    parser = get_reasoning_parser("openai_gptoss")
    assert parser.extract(SPEC_ANSWER) == EXPECTED[SPEC_ANSWER][:2]
    assert parser.extract("<|channel|>final<|message|>4") == (None, "4")


# ---- chat responses ------------------------------------------------------------------------


def _respond(pieces: list[str], *, stream: bool, tools: ToolChoice | None = None,
             **script: Any) -> tuple[Completion, list[dict[str, Any]]]:  # fmt: skip
    parser = "openai" if tools is not None and tools.mode == "auto" else None
    start = StreamStart(3, tool_call_parser=parser, reasoning_parser="openai_gptoss")
    return scripted_chat(start, pieces, stream=stream, tools=tools, **script)


def _tokens(text: str) -> list[str]:
    """``text`` as the model writes it: each special token one token, other text three
    characters a token."""
    tokens = []
    for part in re.split(r"(<\|[a-z]+\|>)", text):
        tokens += [part] if part.startswith("<|") else re.findall(".{1,3}", part, re.DOTALL)
    return tokens


@pytest.mark.parametrize(
    ("text", "finish"),
    [(SPEC_ANSWER, "stop"), (SPEC_CALL, "tool_calls"), (BARE_RECIPIENT, "tool_calls"),
     (NO_FUNCTION_NAME, "stop")],
)  # fmt: skip
def test_chat_message_and_chunks_agree(text: str, finish: str) -> None:
    reasoning, content, calls = EXPECTED[text]
    whole, _ = _respond([text], stream=False, tools=ToolChoice("auto"))
    choice = whole.whole()["choices"][0]
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    got = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    assert got == calls and choice["finish_reason"] == finish
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    _, chunks = _respond(pieces, stream=True, tools=ToolChoice("auto"))
    assert chunks[0]["delta"]["role"] == "assistant" and chunks[-1]["finish_reason"] == finish
    assert not any("<|" in json.dumps(c) for c in chunks)
    streamed = "".join(c["delta"].get("reasoning_content") or "" for c in chunks)
    assert streamed == reasoning
    assert all(c["delta"].get("reasoning") == c["delta"].get("reasoning_content") for c in chunks)
    assert message["reasoning"] == message["reasoning_content"]
    assert ("".join(c["delta"].get("content") or "" for c in chunks) or None) == content
    arguments = "".join(t["function"]["arguments"] for c in chunks
                        for t in c["delta"].get("tool_calls", ()))  # fmt: skip
    assert arguments == "".join(a for _, a in calls)


@pytest.mark.parametrize("tools", [ToolChoice("auto"), None])
@pytest.mark.parametrize("text", [SPEC_ANSWER, SPEC_CALL])
def test_streamed_logprobs_add_up_to_the_whole(text: str, tools: ToolChoice | None) -> None:
    """Tokens whose text the reader holds back (a header, <|end|>) send their logprobs in a
    chunk with an empty delta, as vLLM does."""
    tokens = _tokens(text)
    whole, _ = _respond(tokens, stream=False, tools=tools, logprobs=True)
    expected = whole.whole()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in expected] == tokens
    _, chunks = _respond(tokens, stream=True, tools=tools, logprobs=True)
    assert [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]] == expected
    assert {} in [c["delta"] for c in chunks]


@pytest.mark.parametrize("text", [SPEC_ANSWER, SPEC_CALL])
def test_include_reasoning_false_leaves_the_analysis_out(text: str) -> None:
    """vLLM's chat ``include_reasoning: false``: no reasoning anywhere, nor the logprobs that
    would show it; content and calls as with it."""
    _, content, calls = EXPECTED[text]
    tokens, auto = _tokens(text), ToolChoice("auto")
    whole, _ = _respond(tokens, stream=False, tools=auto, logprobs=True, include_reasoning=False)
    choice = whole.whole()["choices"][0]
    message = choice["message"]
    assert not {"reasoning", "reasoning_content"} & set(message) and choice["logprobs"] is None
    assert message["content"] == content
    got = [(c["function"]["name"], c["function"]["arguments"])
           for c in message.get("tool_calls", [])]  # fmt: skip
    assert got == calls
    _, chunks = _respond(tokens, stream=True, tools=auto, logprobs=True, include_reasoning=False)
    assert not any({"reasoning", "reasoning_content"} & set(c["delta"]) or c["logprobs"]
                   for c in chunks)  # fmt: skip
    assert ("".join(c["delta"].get("content") or "" for c in chunks) or None) == content
    arguments = "".join(t["function"]["arguments"] for c in chunks
                        for t in c["delta"].get("tool_calls", ()))  # fmt: skip
    assert arguments == "".join(a for _, a in calls)
    assert chunks[-1]["finish_reason"] == choice["finish_reason"]


def test_chat_without_tools_has_reasoning_and_content() -> None:
    whole, _ = _respond([SPEC_ANSWER], stream=False)
    message = whole.whole()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == EXPECTED[SPEC_ANSWER][:2]
    assert "tool_calls" not in message


def test_a_forced_call_is_json_from_the_first_token() -> None:
    """tool_choice naming a function: the grammar makes the whole output its arguments (no
    channel): no reasoning, the call as for any model."""
    named = ToolChoice("named", name="get_weather")
    whole, _ = _respond(['{"location": "Oslo"}'], stream=False, tools=named)
    message = whole.whole()["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] is None
    assert message["tool_calls"][0]["function"]["arguments"] == '{"location": "Oslo"}'
    _, chunks = _respond(['{"location":', ' "Oslo"}'], stream=True, tools=named)
    assert not any("reasoning_content" in c["delta"] for c in chunks)


# ---- the front ------------------------------------------------------------------------------


def test_the_front_refuses_a_tokenizer_without_harmony_tokens() -> None:
    class Tokenizer:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [1, 2]

    with pytest.raises(ConfigError, match=r"reasoning_parser: 'openai_gptoss' needs <\|start"):
        reasoning_front("openai_gptoss", Tokenizer())


SPECIAL = {name.strip("<|>"): i for name, i in HARMONY_TOKEN_IDS.items()}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]  # fmt: skip
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def harmony_grammar(answer: str) -> str:
    """An xgrammar EBNF grammar of a harmony transcript: reasoning on the analysis channel, then
    ``answer`` ("call": a call of get_weather with a city; "final": a final answer). The special
    tokens are ``Token(id)`` elements; the stop token that ends it is left to the engine's stop
    tokens (a grammar cannot name one), picked by ``logit_bias``."""
    t = {k: f"Token({v})" for k, v in SPECIAL.items()}
    reasoning = f'{t["channel"]} "analysis" {t["message"]} [a-z ]{{1,16}} {t["end"]}'
    if answer == "call":
        rest = (f'{t["channel"]} "commentary to=functions.get_weather " {t["constrain"]} "json" '
                f'{t["message"]} "{{\\"city\\": \\"" [A-Z] [a-z]{{2,8}} "\\"}}"')  # fmt: skip
    else:
        rest = f'{t["channel"]} "final" {t["message"]} [A-Za-z ]{{1,16}}'
    return f'root ::= {reasoning} {t["start"]} "assistant" {rest}'


def harmony_params(answer: str) -> dict[str, Any]:
    stop = SPECIAL["call"] if answer == "call" else SPECIAL["return"]
    return {"temperature": 0, "max_tokens": 80, "logit_bias": {stop: 100.0},
            "structured_outputs": {"grammar": harmony_grammar(answer)}}  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[LLMServer]:
    args = {"model": "builtin:tiny-gpt-oss", "num_kv_blocks": 64, "device": "cpu",
            "enable_auto_tool_choice": True}  # fmt: skip
    server = LLMServer("g", args)
    yield server
    server.engine.shutdown()


def _serve(server: LLMServer, request: GenerateRequest, stream: bool
           ) -> tuple[Completion, list[Any], list[Any]]:  # fmt: skip
    async def run() -> tuple[Completion, list[Any], list[Any]]:
        tools = ToolChoice("auto") if request.tool_choice == "auto" else None
        completion = Completion("g", True, False, tools=tools, stream=stream)
        items, chunks = [], []
        async for item in server.generate(request):
            assert not isinstance(item, StreamError), item
            items.append(item)
            chunks += completion.absorb(item)
        return completion, items, chunks

    return asyncio.run(run())


def test_gpt_oss_defaults_to_the_harmony_parsers(server: LLMServer) -> None:
    frontend = server.config.frontend
    assert (frontend.reasoning_parser, frontend.tool_call_parser) == ("openai_gptoss", "openai")


@pytest.mark.parametrize("answer", ["call", "final"])
def test_server_reads_the_models_transcript(server: LLMServer, answer: str) -> None:
    """The text comes from the head with its special tokens (the reader needs them) and without
    the stop token; the response has none of them."""
    request = GenerateRequest(messages=QUESTION, params=harmony_params(answer), tools=TOOLS,
                              tool_choice="auto")  # fmt: skip
    whole, items, _ = _serve(server, request, stream=False)
    start, deltas = items[0], items[1:]
    assert (start.reasoning_parser, start.tool_call_parser) == ("openai_gptoss", "openai")
    text = "".join(c.text for d in deltas for c in d.choices)
    assert text.startswith("<|channel|>analysis<|message|>") and "<|end|><|start|>" in text
    assert not text.endswith(("<|call|>", "<|return|>"))
    choice = whole.whole()["choices"][0]
    message = choice["message"]
    reasoning = text.split("<|message|>")[1].split("<|end|>")[0]
    assert message["reasoning_content"] == reasoning
    if answer == "call":
        assert choice["finish_reason"] == "tool_calls" and message["content"] is None
        call = message["tool_calls"][0]["function"]
        assert call["name"] == "get_weather"
        assert list(json.loads(call["arguments"])) == ["city"]
    else:
        assert choice["finish_reason"] == "stop" and "tool_calls" not in message
        assert message["content"] == text.rsplit("<|message|>", 1)[1]
    _, _, chunks = _serve(server, request, stream=True)
    assert not any("<|" in json.dumps(c) for c in chunks)
    assert chunks[-1]["finish_reason"] == choice["finish_reason"]


ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}  # fmt: skip


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_an_assistant_messages_reasoning_reaches_the_template(
    server: LLMServer, field: str
) -> None:
    """``reasoning`` is vLLM 0.32's name for ``reasoning_content`` (its responses return it):
    an unfinished turn's analysis is rendered before its call either way."""
    messages = [*QUESTION, {**ASSISTANT_CALL, field: "Need the weather."},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'}]  # fmt: skip
    request = ChatCompletionRequest.model_validate({"model": "g", "messages": messages})
    payload = chat_payload(request)
    prompt = server.tokenizer.decode(chat_prompt_ids(server.tokenizer, payload.messages))
    assert "<|channel|>analysis<|message|>Need the weather.<|end|>" in prompt


def test_reasoning_and_reasoning_content_that_differ_are_refused() -> None:
    message = {**ASSISTANT_CALL, "reasoning": "A", "reasoning_content": "B"}
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate({"model": "g", "messages": [*QUESTION, message]})
    (error,) = refused.value.errors()
    assert error["loc"] == ("messages", 1, "reasoning")
    assert "differs from reasoning_content" in error["msg"]


def test_reasoning_effort_reaches_the_template(server: LLMServer) -> None:
    for effort in ("high", None):
        kwargs = {"reasoning_effort": effort} if effort else None
        request = GenerateRequest(messages=QUESTION, params={"max_tokens": 1}, echo=True,
                                  chat_template_kwargs=kwargs)  # fmt: skip
        _, items, _ = _serve(server, request, stream=False)
        assert f"Reasoning: {effort or 'medium'}\n" in items[0].prompt_text
