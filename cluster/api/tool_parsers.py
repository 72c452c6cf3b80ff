"""OpenAI tool calling: tool calls read out of generated text, whole or while it streams, in
each model family's format (vLLM's ``tool_call_parser`` names):

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call> blocks (Qwen2.5)
    llama3_json  the whole message, optionally after <|python_tag|>, is {"name", "parameters"}
    glm45        <tool_call>f <arg_key>k</arg_key><arg_value>v</arg_value> ...</tool_call>
    openai       gpt-oss's harmony messages <|channel|>commentary to=functions.f ...<|message|>
                 {...}, read by channel in ``cluster.api.harmony``

A streamer turns text deltas into OpenAI ``delta`` dicts (:data:`Delta`): content, a call's
header once, then its argument fragments, which concatenate to the ``arguments`` that
:meth:`ToolParser.parse` gives for the whole text. Text that may still start a call is held back
until decided; malformed calls are content, and the parsers never raise on model output (a call
whose header was streamed stays a call). Calls the API forces are read by
``cluster.api.forced_tool_calls``; the pieces both share are ``cluster.api.tool_calls``.
"""

from __future__ import annotations

import json
import re

from cluster.api.harmony import HarmonyReader, Piece
from cluster.api.tool_calls import (
    WHITESPACE,
    CallStream,
    Delta,
    Deltas,
    ParsedToolCalls,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    call_from_json,
    fold_deltas,
    fold_stream,
    held_suffix,
    make_tool_call_id,
)


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks."""

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"
    # A block the generation stopped inside (no end tag) still counts if its JSON is whole.
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedToolCalls:
        calls: list[ToolCall] = []
        content: list[str] = []
        start = 0
        for match in self._BLOCK.finditer(text):
            call = call_from_json(match.group(1))
            if call is None:
                continue  # a malformed block stays in the content around it
            before = text[start : match.start()]
            content.append((before.lstrip(WHITESPACE) if calls else before).rstrip(WHITESPACE))
            calls.append(call)
            start = match.end()
        rest = text[start:]
        content.append(rest.lstrip(WHITESPACE) if calls else rest)
        return ParsedToolCalls("".join(content) or None, calls)

    def streamer(self) -> ToolCallStreamer:
        return _HermesStreamer()


class _HermesStreamer(ToolCallStreamer):
    """Modes: "text" (content, holding back a possible start tag and the whitespace before it),
    "call" (inside a block, reading the call object), "after_call" (object read, waiting for the
    end tag) and "bad_block" (a block that is no call: content through its end tag)."""

    def __init__(self) -> None:
        self._mode = "text"
        self._pending = ""  # held back: whitespace and a partial tag
        self._held_ws = ""  # the whitespace before the current block's start tag
        self._block_raw = ""  # the current block so far, content if it is no call after all
        self._strip_leading = False  # right after a call's block, whitespace is not content
        self._call = CallStream(0)  # the current (or last) block's call
        self._num_calls = 0

    @property
    def tools_called(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> list[Delta]:
        out = Deltas()
        handlers = {
            "text": self._text,
            "call": self._in_call,
            "after_call": self._after_call,
            "bad_block": self._bad_block,
        }
        while text:
            text = handlers[self._mode](text, out)
        return out.items

    def finish(self) -> list[Delta]:
        out = Deltas()
        if self._mode in ("text", "bad_block"):
            out.content(self._pending)
        elif self._mode == "call" and not self._call.header_sent:
            out.content(self._held_ws + self._block_raw)
        self._mode, self._pending = "text", ""
        return out.items

    def _text(self, text: str, out: Deltas) -> str:
        buf = self._pending + text
        self._pending = ""
        if self._strip_leading:
            buf = buf.lstrip(WHITESPACE)
            if not buf:
                return ""
            self._strip_leading = False
        start = buf.find(HermesToolParser.START)
        if start >= 0:
            before = buf[:start]
            kept = before.rstrip(WHITESPACE)
            out.content(kept)
            self._held_ws = before[len(kept) :]
            self._block_raw = HermesToolParser.START
            self._call = CallStream(self._num_calls)
            self._mode = "call"
            return buf[start + len(HermesToolParser.START) :]
        undecided = len(buf) - held_suffix(buf, HermesToolParser.START)
        kept = buf[:undecided].rstrip(WHITESPACE)
        out.content(kept)
        self._pending = buf[len(kept) :]
        return ""

    def _in_call(self, text: str, out: Deltas) -> str:
        call = self._call
        was_sent = call.header_sent
        consumed = call.feed(text, out)
        self._block_raw += text[:consumed]
        if call.header_sent and not was_sent:
            self._num_calls += 1
        if call.scanner.error and not call.header_sent:
            out.content(self._held_ws + self._block_raw)
            self._mode = "bad_block"
        elif call.scanner.done or call.scanner.error:
            self._mode = "after_call"
        return text[consumed:]

    def _after_call(self, text: str, out: Deltas) -> str:
        buf = self._pending + text
        end = buf.find(HermesToolParser.END)
        if end >= 0:
            self._pending = ""
            self._mode, self._strip_leading = "text", True
            return buf[end + len(HermesToolParser.END) :]
        # Anything but the end tag between the object and it is dropped.
        self._pending = buf[len(buf) - held_suffix(buf, HermesToolParser.END) :]
        return ""

    def _bad_block(self, text: str, out: Deltas) -> str:
        buf = self._pending + text
        self._pending = ""
        end = buf.find(HermesToolParser.END)
        if end >= 0:
            out.content(buf[: end + len(HermesToolParser.END)])
            self._mode = "text"
            return buf[end + len(HermesToolParser.END) :]
        undecided = len(buf) - held_suffix(buf, HermesToolParser.END)
        out.content(buf[:undecided])
        self._pending = buf[undecided:]
        return ""


class Glm45ToolParser(ToolParser):
    """GLM-4.5 / 4.6: ``<tool_call>`` blocks of a function name, then ``<arg_key>`` /
    ``<arg_value>`` pairs (GLM's chat template writes them one per line)::

        <tool_call>get_weather
        <arg_key>city</arg_key>
        <arg_value>Beijing</arg_value>
        <arg_key>days</arg_key>
        <arg_value>3</arg_value>
        </tool_call>

    Values are bare text: one the tool declares a string is taken as written; any other is read
    as JSON (``3`` a number, ``{"a": 1}`` an object) and kept a string where it is not JSON, as
    vLLM's ``glm45`` parser does. A call's ``arguments`` is the JSON object of its pairs, in
    their order; streamed, each pair is sent once its ``</arg_value>`` arrives. A block that is
    no such call (no name, text between the pairs) is content. The whole-text split is the
    stream's, folded (``fold_stream``)."""

    name = "glm45"
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def parse(self, text: str) -> ParsedToolCalls:
        return fold_stream(self.streamer(), text)

    def streamer(self) -> ToolCallStreamer:
        return _Glm45Streamer(self.string_parameters)

    @classmethod
    def read_block(cls, body: str, complete: bool) -> tuple[str, str | None, list[tuple[str, str]]]:
        """(state, name, pairs) of a block's text so far: state "ok" (well formed so far),
        "partial" (the name is not whole yet) or "bad"."""
        ends = [i for i in (body.find("\n"), body.find("<arg_key>")) if i >= 0]
        if not ends and not complete:
            return ("bad" if "<" in body and not "<arg_key>".startswith(body[body.find("<") :])
                    else "partial"), None, []  # fmt: skip
        cut = min(ends) if ends else len(body)
        name = body[:cut].strip(WHITESPACE)
        if not name or any(ch in name for ch in "<>"):
            return "bad", None, []
        pairs: list[tuple[str, str]] = []
        rest, pos = body[cut:], 0
        while True:
            while pos < len(rest) and rest[pos] in WHITESPACE:
                pos += 1
            if pos == len(rest):
                return "ok", name, pairs
            match = cls._PAIR.match(rest, pos)
            if match is None:
                tail = rest[pos:]
                unfinished = tail.startswith("<arg_key>") and "</arg_value>" not in tail
                # Not closed yet: a pair still arriving, or the end tag's beginning.
                pending = unfinished or any(
                    t.startswith(tail) for t in ("<arg_key>", "</tool_call>")
                )
                if not complete and pending:
                    return "ok", name, pairs
                return "bad", name, pairs
            pairs.append((match[1].strip(WHITESPACE), match[2]))
            pos = match.end()


class _Glm45Streamer(_HermesStreamer):
    """The Hermes streamer's text handling (the same block tags) with GLM's block body: a call
    is announced with its first pair (or at its end tag, with none), so a block that turns out
    malformed before then is still content."""

    def __init__(self, string_parameters: frozenset[tuple[str, str]]) -> None:
        super().__init__()
        self._string_parameters = string_parameters
        self._pairs_sent = 0

    def _in_call(self, text: str, out: Deltas, at_end: bool = False) -> str:
        start = len(HermesToolParser.START)
        buf = self._block_raw + text
        end = buf.find(HermesToolParser.END, start)
        closed = end >= 0 or at_end
        body = buf[start:] if end < 0 else buf[start:end]
        block = buf if end < 0 else buf[: end + len(HermesToolParser.END)]
        rest = "" if end < 0 else buf[end + len(HermesToolParser.END) :]
        state, name, pairs = Glm45ToolParser.read_block(body, complete=closed)
        call = self._call
        if not closed and (state == "partial" or (state == "ok" and not call.header_sent
                                                  and not pairs)):  # fmt: skip
            self._block_raw = buf
            return ""
        if state == "bad" and not call.header_sent:
            # No call after all: the block, through its end tag if it came, is content (the
            # beginning of an end tag at its end waits for the rest of the tag).
            held = 0 if closed else held_suffix(block, HermesToolParser.END)
            out.content(self._held_ws + block[: len(block) - held])
            self._block_raw, self._pending = "", block[len(block) - held :]
            self._mode = "text" if closed else "bad_block"
            return rest
        if not call.header_sent:
            out.header(call.index, call.id, name or "")
            call.header_sent = True
            self._num_calls += 1
            self._pairs_sent = 0
        for key, value in pairs[self._pairs_sent :]:
            lead = "{" if self._pairs_sent == 0 else ", "
            out.arguments(call.index, lead + json.dumps(key, ensure_ascii=False) + ": "
                          + self._value(name or "", key, value))  # fmt: skip
            self._pairs_sent += 1
        if state == "ok" and not closed:
            self._block_raw = buf
            return ""
        out.arguments(call.index, "}" if self._pairs_sent else "{}")
        self._block_raw, self._strip_leading = "", True
        # Malformed after the announcement: the rest of the block (to its end tag) is dropped.
        self._mode = "text" if closed else "after_call"
        return rest

    def _value(self, function: str, key: str, value: str) -> str:
        if (function, key) not in self._string_parameters:
            try:
                return json.dumps(json.loads(value), ensure_ascii=False)
            except ValueError:
                pass
        return json.dumps(value, ensure_ascii=False)

    def finish(self) -> list[Delta]:
        out = Deltas()
        if self._mode == "call":
            # Cut off inside a block: a call as far as it is well formed, else content.
            self._in_call("", out, at_end=True)
        return out.items + super().finish()


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": ...}``, several joined by ``;``, as the
    whole message, optionally after ``<|python_tag|>``. Anything else is content."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedToolCalls:
        body = text.strip(WHITESPACE)
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG) :].lstrip(WHITESPACE)
        calls: list[ToolCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while body.startswith("{", pos):
            try:
                _, end = decoder.raw_decode(body, pos)
            except ValueError:
                break
            call = call_from_json(body[pos:end])
            if call is None:
                break
            calls.append(call)
            pos = _skip_whitespace(body, end)
            if pos == len(body):
                return ParsedToolCalls(None, calls)
            if body[pos] != ";":
                break
            pos = _skip_whitespace(body, pos + 1)
            if pos == len(body):
                return ParsedToolCalls(None, calls)
        return ParsedToolCalls(text or None, [])

    def streamer(self) -> ToolCallStreamer:
        return _Llama3JsonStreamer()


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


class _Llama3JsonStreamer(ToolCallStreamer):
    """Modes: "start" (holding the message's opening until its first character after an optional
    python tag tells calls from content), "call", "between" (after an object: ";" or the end),
    "next" (after ";": the next object) and "text" (everything else is content)."""

    def __init__(self) -> None:
        self._mode = "start"
        self._held = ""  # everything so far while no call has been announced
        self._call = CallStream(0)
        self._num_calls = 0

    @property
    def tools_called(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> list[Delta]:
        out = Deltas()
        while text:
            text = self._step(text, out)
        return out.items

    def finish(self) -> list[Delta]:
        out = Deltas()
        if self._num_calls == 0:
            out.content(self._held)
        self._held = ""
        self._mode = "text"
        return out.items

    def _step(self, text: str, out: Deltas) -> str:
        if self._mode == "text":
            out.content(text)
            return ""
        if self._num_calls == 0 and self._mode != "call":
            self._held += text
            return self._start() if self._mode == "start" else ""
        if self._mode == "call":
            return self._in_call(text, out)
        rest = text.lstrip(WHITESPACE)
        if not rest:
            return ""
        if self._mode == "between" and rest[0] == ";":
            self._mode = "next"
            return rest[1:]
        if self._mode == "next" and rest[0] == "{":
            self._call = CallStream(self._num_calls)
            self._mode = "call"
            return rest
        # Junk after the calls: it cannot take them back, so it is content from here on.
        self._mode = "text"
        return rest

    def _start(self) -> str:
        body = self._held.lstrip(WHITESPACE)
        tag = Llama3JsonToolParser.PYTHON_TAG
        if body.startswith(tag):
            body = body[len(tag) :].lstrip(WHITESPACE)
        elif tag.startswith(body):
            return ""
        if not body:
            return ""
        if body[0] != "{":
            self._mode = "text"
            held, self._held = self._held, ""
            return held
        # The object's text is fed to the call from the held text, which keeps it all.
        self._held = self._held[: len(self._held) - len(body)]
        self._mode = "call"
        return body

    def _in_call(self, text: str, out: Deltas) -> str:
        call = self._call
        consumed = call.feed(text, out)
        if self._num_calls == 0:
            self._held += text[:consumed]
        if call.header_sent and call.index == self._num_calls:
            self._num_calls += 1
            self._held = ""
        if call.scanner.error and not call.header_sent:
            held, self._held = self._held, ""
            self._mode = "text"
            return held + text[consumed:]
        if call.scanner.error:
            self._mode = "text"
        elif call.scanner.done:
            self._mode = "between"
        return text[consumed:]


class OpenAIToolParser(ToolParser):
    """gpt-oss (vLLM's ``openai``): calls are harmony messages to ``functions.NAME``, their
    text the arguments as JSON; the final channel and commentary preambles are the content,
    the analysis channel is left out (the ``openai_gptoss`` reasoning parser's)."""

    name = "openai"

    def parse(self, text: str) -> ParsedToolCalls:
        return fold_stream(self.streamer(), text)

    def streamer(self) -> ToolCallStreamer:
        return HarmonyStreamer()


class HarmonyStreamer(ToolCallStreamer):
    """A harmony output's deltas (``cluster.api.harmony``): content; with ``reasoning``, the
    analysis channel as ``reasoning_content`` deltas (else left out); each call's header once
    its message's header is whole, then its arguments as they arrive. ``read_calls`` False
    (a chat without tools): calls are content."""

    def __init__(self, *, reasoning: bool = False, read_calls: bool = True) -> None:
        self._reader = HarmonyReader(read_calls)
        self._reasoning = reasoning
        self._num_calls = 0

    @property
    def tools_called(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(self._reader.feed(text))

    def finish(self) -> list[Delta]:
        return self._deltas(self._reader.finish())

    def _deltas(self, pieces: list[Piece]) -> list[Delta]:
        out = Deltas()
        for piece in pieces:
            if piece.kind == "content":
                out.content(piece.text)
            elif piece.kind == "reasoning" and self._reasoning:
                out.reasoning(piece.text)
            elif piece.kind == "call":
                out.header(self._num_calls, make_tool_call_id(), piece.text)
                self._num_calls += 1
            elif piece.kind == "arguments":
                out.arguments(self._num_calls - 1, piece.text)
        return out.items


def parse_harmony(text: str, read_calls: bool = True) -> tuple[str | None, ParsedToolCalls]:
    """A whole harmony output's reasoning (None without any), content and calls: the stream's,
    folded."""
    streamer = HarmonyStreamer(reasoning=True, read_calls=read_calls)
    deltas = streamer.feed(text) + streamer.finish()
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    return ("".join(reasoning) if reasoning else None), fold_deltas(deltas)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, Glm45ToolParser, OpenAIToolParser)
}


def get_tool_parser(
    name: str, string_parameters: frozenset[tuple[str, str]] = frozenset()
) -> ToolParser:
    """The parser registered as ``name``, for a request whose tools declare
    ``string_parameters``; ValueError listing the valid names."""
    try:
        return TOOL_PARSERS[name](string_parameters)
    except KeyError:
        valid = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool_call_parser {name!r}; valid names are {valid}") from None
