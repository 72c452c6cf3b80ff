"""OpenAI tool calling: tool calls read out of generated text, whole or while it streams, in
each model family's format (vLLM's ``tool_call_parser`` names):

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call> blocks (Qwen2.5)
    llama3_json  the whole message, optionally after <|python_tag|>, is {"name", "parameters"}
    glm45        <tool_call>f <arg_key>k</arg_key><arg_value>v</arg_value> ...</tool_call>
    openai       gpt-oss's harmony messages <|channel|>commentary to=functions.f ...<|message|>
                 {...}, read by channel in ``cluster.api.harmony``
    deepseek_v3, deepseek_v31   ``cluster.api.tool_parsers_deepseek``
    kimi_k2      ``cluster.api.tool_parsers_kimi``
    qwen3_coder  ``cluster.api.tool_parsers_qwen3_coder``

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
from collections.abc import Mapping
from typing import Any

from cluster.api.harmony import HarmonyReader, Piece
from cluster.api.tool_calls import (
    WHITESPACE,
    CallStream,
    Delta,
    Deltas,
    ParsedToolCalls,
    ToolCallStreamer,
    ToolParser,
    fold_deltas,
    fold_stream,
    held_suffix,
    make_tool_call_id,
)
from cluster.api.tool_parsers_deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from cluster.api.tool_parsers_kimi import KimiK2ToolParser
from cluster.api.tool_parsers_qwen3_coder import Qwen3CoderToolParser


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks. A
    block the generation stopped inside (no end tag) still counts if its JSON is whole. The
    whole-text split is the stream's, folded, with each call announced only once its object
    is whole and valid JSON."""

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"

    def parse(self, text: str) -> ParsedToolCalls:
        return fold_stream(_HermesStreamer(whole_text=True), text)

    def streamer(self) -> ToolCallStreamer:
        return _HermesStreamer()


class _HermesStreamer(ToolCallStreamer):
    """Modes: "text" (content, holding back a possible start tag), "call" (inside a block,
    reading the call object), "after_call" (the call is over: what follows in its block is
    held until the end tag drops it or the output ends and it is content) and "bad_block" (a
    block that is no call: content through its end tag).

    Content is the text outside call blocks as written, less the whitespace that only
    separates a call block from the start or end of the message or from another call: the
    whitespace next to a call is held (``_gap``) until text after it shows that content lies
    on both sides."""

    def __init__(self, whole_text: bool = False) -> None:
        self._mode = "text"
        self._pending = ""  # held back: a partial tag, or the tail of a call's block
        self._gap = ""  # whitespace not yet sent as content
        self._gap_at_call = False  # a call block lies next to the gap
        self._content_sent = False
        self._keep_tail = False  # whether a call's held tail is content if the output ends
        self._block_raw = ""  # the current block so far, content if it is no call after all
        self._whole_text = whole_text
        self._call = CallStream(0)  # the current (or last) block's call
        self._num_calls = 0

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
        if self._mode == "call" and not self._call.header_sent:
            self._say(self._block_raw, out)
        elif self._mode in ("text", "bad_block") or self._keep_tail:
            self._say(self._pending, out)
        # A call cut off after its header went out stays a call (vLLM's stream does the same).
        if not self._gap_at_call:
            out.content(self._gap)
        self._mode, self._pending, self._gap, self._keep_tail = "text", "", "", False
        return out.items

    def _say(self, text: str, out: Deltas) -> None:
        """Content outside call blocks; trailing whitespace waits in the gap."""
        full = self._gap + text
        kept = full.rstrip(WHITESPACE)
        if not kept:
            self._gap = full
            return
        if self._gap_at_call and not self._content_sent:
            kept = kept.lstrip(WHITESPACE)
        out.content(kept)
        self._content_sent = True
        self._gap, self._gap_at_call = full[len(full.rstrip(WHITESPACE)) :], False

    def _call_announced(self) -> None:
        self._num_calls += 1
        self._gap_at_call = True

    def _text(self, text: str, out: Deltas) -> str:
        buf = self._pending + text
        self._pending = ""
        start = buf.find(HermesToolParser.START)
        if start >= 0:
            self._say(buf[:start], out)
            self._block_raw = HermesToolParser.START
            self._call = CallStream(self._num_calls, whole_text=self._whole_text)
            self._mode = "call"
            return buf[start + len(HermesToolParser.START) :]
        undecided = len(buf) - held_suffix(buf, HermesToolParser.START)
        self._say(buf[:undecided], out)
        self._pending = buf[undecided:]
        return ""

    def _in_call(self, text: str, out: Deltas) -> str:
        call = self._call
        was_sent = call.header_sent
        consumed = call.feed(text, out)
        self._block_raw += text[:consumed]
        if call.header_sent and not was_sent:
            self._call_announced()
        if call.scanner.error and not call.header_sent:
            self._say(self._block_raw, out)
            self._mode = "bad_block"
        elif call.scanner.done or call.scanner.error:
            # Malformed after its header went out (a later feed than the one that announced
            # it), the call stays with the arguments sent so far, as in vLLM's stream (which
            # also sends the rest of the block raw); the whole text makes it content.
            self._mode, self._keep_tail = "after_call", call.scanner.done
        return text[consumed:]

    def _after_call(self, text: str, out: Deltas) -> str:
        buf = self._pending + text
        ends = [i for i in (buf.find(HermesToolParser.END), buf.find(HermesToolParser.START))
                if i >= 0]  # fmt: skip
        if not ends:
            self._pending = buf
            return ""
        # Text between a call and its block's end tag is dropped; a start tag with no end tag
        # before it ends the block too.
        end = min(ends)
        self._pending, self._mode, self._keep_tail = "", "text", False
        if buf.startswith(HermesToolParser.END, end):
            return buf[end + len(HermesToolParser.END) :]
        return buf[end:]

    def _bad_block(self, text: str, out: Deltas) -> str:
        buf = self._pending + text
        self._pending = ""
        end = buf.find(HermesToolParser.END)
        if end >= 0:
            self._say(buf[: end + len(HermesToolParser.END)], out)
            self._mode = "text"
            return buf[end + len(HermesToolParser.END) :]
        undecided = len(buf) - held_suffix(buf, HermesToolParser.END)
        self._say(buf[:undecided], out)
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
    as JSON (``3`` a number, ``{"a": 1}`` an object) and kept a string where it is not JSON (but
    ``True`` / ``False`` for a declared boolean is one), as vLLM's ``glm45`` parser does. A
    call's ``arguments`` is the JSON object of its pairs, in their order; streamed, each pair is
    sent once its ``</arg_value>`` arrives. A block that is no such call (no name, text between
    the pairs) is content. The whole-text split is the stream's, folded (``fold_stream``)."""

    name = "glm45"
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def parse(self, text: str) -> ParsedToolCalls:
        return fold_stream(self.streamer(), text)

    def streamer(self) -> ToolCallStreamer:
        schemas = self.parameter_schemas.items()
        booleans = frozenset(key for key, schema in schemas if schema.get("type") == "boolean")
        return _Glm45Streamer(self.string_parameters, booleans)

    @classmethod
    def read_block(
        cls, body: str, complete: bool
    ) -> tuple[str, str | None, list[tuple[str, str]], int]:
        """(state, name, pairs, good) of a block's text so far: state "ok" (well formed so
        far), "partial" (the name is not whole yet) or "bad"; ``good`` is where the well-formed
        beginning (the name and whole pairs) ends."""
        ends = [i for i in (body.find("\n"), body.find("<arg_key>")) if i >= 0]
        if not ends and not complete:
            return ("bad" if "<" in body and not "<arg_key>".startswith(body[body.find("<") :])
                    else "partial"), None, [], 0  # fmt: skip
        cut = min(ends) if ends else len(body)
        name = body[:cut].strip(WHITESPACE)
        if not name or any(ch in name for ch in "<>"):
            return "bad", None, [], 0
        pairs: list[tuple[str, str]] = []
        good = cut
        while True:
            pos = good
            while pos < len(body) and body[pos] in WHITESPACE:
                pos += 1
            if pos == len(body):
                return "ok", name, pairs, good
            match = cls._PAIR.match(body, pos)
            if match is None:
                tail = body[pos:]
                unfinished = tail.startswith("<arg_key>") and "</arg_value>" not in tail
                # Not closed yet: a pair still arriving, or the end tag's beginning.
                pending = unfinished or any(
                    t.startswith(tail) for t in ("<arg_key>", "</tool_call>")
                )
                return ("ok" if not complete and pending else "bad"), name, pairs, good
            pairs.append((match[1].strip(WHITESPACE), match[2]))
            good = match.end()


class _Glm45Streamer(_HermesStreamer):
    """The Hermes streamer's text handling (the same block tags) with GLM's block body: a call
    is announced with its first whole pair (or at its end tag, with none), so a block that is
    malformed before then is content, in whatever pieces it arrives. Text that breaks a call
    after that ends its arguments: up to the end tag it is dropped, and where no end tag comes
    it is content."""

    def __init__(
        self,
        string_parameters: frozenset[tuple[str, str]],
        boolean_parameters: frozenset[tuple[str, str]] = frozenset(),
    ) -> None:
        super().__init__()
        self._string_parameters = string_parameters
        self._boolean_parameters = boolean_parameters
        self._pairs_sent = 0

    def _in_call(self, text: str, out: Deltas, at_end: bool = False) -> str:
        start = len(HermesToolParser.START)
        buf = self._block_raw + text
        end = buf.find(HermesToolParser.END, start)
        closed = end >= 0 or at_end
        body = buf[start:] if end < 0 else buf[start:end]
        block = buf if end < 0 else buf[: end + len(HermesToolParser.END)]
        rest = "" if end < 0 else buf[end + len(HermesToolParser.END) :]
        state, name, pairs, good = Glm45ToolParser.read_block(body, complete=closed)
        if not closed and (state == "partial" or (state == "ok" and not pairs)):
            self._block_raw = buf
            return ""
        if state == "bad" and not pairs:
            # No call after all: the block, through its end tag if it came, is content (the
            # beginning of an end tag at its end waits for the rest of the tag).
            held = 0 if closed else held_suffix(block, HermesToolParser.END)
            self._say(block[: len(block) - held], out)
            self._block_raw, self._pending = "", block[len(block) - held :]
            self._mode = "text" if closed else "bad_block"
            return rest
        call = self._call
        if not call.header_sent:
            out.header(call.index, call.id, name or "")
            call.header_sent = True
            self._call_announced()
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
        self._block_raw, self._mode = "", "text"
        cut_in_a_pair = at_end and Glm45ToolParser.read_block(body, complete=False)[0] == "ok"
        if state == "bad" and end < 0 and not cut_in_a_pair:
            self._mode, self._pending, self._keep_tail = "after_call", body[good:], True
        return rest

    def _value(self, function: str, key: str, value: str) -> str:
        if (function, key) not in self._string_parameters:
            try:
                return json.dumps(json.loads(value), ensure_ascii=False)
            except (ValueError, RecursionError):
                pass
        word = value.strip().lower()
        if (function, key) in self._boolean_parameters and word in ("true", "false"):
            return word  # a boolean written as Python writes it (``True``), as vLLM reads it
        return json.dumps(value, ensure_ascii=False)

    def finish(self) -> list[Delta]:
        out = Deltas()
        if self._mode == "call":
            # Cut off inside a block: a call as far as it is well formed, else content.
            self._in_call("", out, at_end=True)
        return out.items + super().finish()


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": ...}`` objects, joined by ``;`` or
    whitespace, from the message's start, optionally after ``<|python_tag|>``; a message that
    starts otherwise is content, and so is text after the calls. The whole-text split is the
    stream's, folded, with each call announced only once its object is whole and valid JSON."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedToolCalls:
        return fold_stream(_Llama3JsonStreamer(whole_text=True), text)

    def streamer(self) -> ToolCallStreamer:
        return _Llama3JsonStreamer()


class _Llama3JsonStreamer(ToolCallStreamer):
    """Modes: "start" (holding the message's opening until its first character after an optional
    python tag tells calls from content), "call", "between" (after an object: ";", the next
    object or the end) and "text" (everything else is content)."""

    def __init__(self, whole_text: bool = False) -> None:
        self._mode = "start"
        self._held = ""  # the current call's text while it is not announced (the first's from
        # the message's start), content if it turns out no call
        self._whole_text = whole_text
        self._call = CallStream(0, whole_text=whole_text)
        self._num_calls = 0

    def feed(self, text: str) -> list[Delta]:
        out = Deltas()
        while text:
            text = self._step(text, out)
        return out.items

    def finish(self) -> list[Delta]:
        out = Deltas()
        # A call cut off after its header went out stays a call (vLLM's stream does the same).
        if self._mode in ("start", "call") and not self._call.header_sent:
            out.content(self._held)
        self._held = ""
        self._mode = "text"
        return out.items

    def _step(self, text: str, out: Deltas) -> str:
        if self._mode == "text":
            out.content(text)
            return ""
        if self._mode == "start":
            self._held += text
            return self._start()
        if self._mode == "call":
            return self._in_call(text, out)
        rest = text.lstrip(WHITESPACE)
        if rest.startswith(";"):
            return rest[1:]
        if rest.startswith("{"):
            self._call = CallStream(self._num_calls, whole_text=self._whole_text)
            self._mode = "call"
        elif rest:
            # Text after the calls: it cannot take them back, so it is content from here on.
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
        was_sent = call.header_sent
        consumed = call.feed(text, out)
        if not was_sent:
            self._held += text[:consumed]
        if call.header_sent and not was_sent:
            self._num_calls += 1
            self._held = ""
        if call.scanner.error and not call.header_sent:
            held, self._held = self._held, ""
            self._mode = "text"
            return held + text[consumed:]
        if call.scanner.error:
            # Malformed after its header went out (in a later feed): the call stays with what
            # it sent, as in vLLM's stream; the rest is content. The whole text has no call.
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
    for parser in (
        HermesToolParser,
        Llama3JsonToolParser,
        Glm45ToolParser,
        OpenAIToolParser,
        KimiK2ToolParser,
        DeepSeekV3ToolParser,
        DeepSeekV31ToolParser,
        Qwen3CoderToolParser,
    )
}


def get_tool_parser(
    name: str, parameter_schemas: Mapping[tuple[str, str], dict[str, Any]] | None = None
) -> ToolParser:
    """The parser registered as ``name``, for a request whose tools declare
    ``parameter_schemas``; ValueError listing the valid names."""
    try:
        return TOOL_PARSERS[name](parameter_schemas)
    except KeyError:
        valid = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool_call_parser {name!r}; valid names are {valid}") from None
