"""DeepSeek tool calls (vLLM's ``deepseek_v3`` and ``deepseek_v31`` parsers), registered in
``cluster.api.tool_parsers``. Both write the calls after the content, in one section::

    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                  ```json
                  ARGUMENTS
                  ```<｜tool▁call▁end｜>  (more calls, one per line) <｜tool▁calls▁end｜>
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS
                  <｜tool▁call▁end｜> (more calls) <｜tool▁calls▁end｜>

ARGUMENTS is passed on as written (vLLM does not re-encode it). Content is the text before
the section (None when only whitespace precedes calls); in the section, whitespace between
calls is dropped and other text is content. A block that is no call is content as written; a
block cut off (by the output's end or a marker other than its end) is a call when its
arguments are whole JSON, or, streamed, once its header went out. The markers are added,
non-special tokens of DeepSeek's tokenizers, kept by the default decoding (vLLM does not
adjust the request either). The whole-text split is the stream's, folded.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from cluster.api.tool_calls import (
    WHITESPACE,
    Delta,
    Deltas,
    ParsedToolCalls,
    ToolCallStreamer,
    ToolParser,
    fold_stream,
    held_suffix,
    make_tool_call_id,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
# Markers that end a call block: its own end tag, or one that cuts it off.
_BLOCK_ENDS = (CALL_END, CALL_BEGIN, CALLS_BEGIN, CALLS_END)
# Markers read between the blocks of the calls section.
_SECTION_MARKERS = (CALL_BEGIN, CALLS_BEGIN, CALLS_END)
_V3_HEAD = "function" + TOOL_SEP
_V3_FENCE = "```json\n"
_V3_CLOSE = "\n```"
_LONGEST_END = max(len(tag) for tag in _BLOCK_ENDS)

# (state, name, where the arguments start) of a block's text after its begin tag: "ok" once
# the name is known and the arguments begin, "partial" while it may still get there, "bad"
# when it never can (a state that holds for every continuation of the text).
Header = tuple[str, str, int]


def _first(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """Where the first of ``tags`` in ``text`` (from ``start``) is, and which (-1 and "" for
    none)."""
    found = (-1, "")
    for tag in tags:
        pos = text.find(tag, start)
        if pos >= 0 and (found[0] < 0 or pos < found[0]):
            found = (pos, tag)
    return found


def _good_name(name: str) -> bool:
    return bool(name.strip(WHITESPACE)) and "\n" not in name and TOOL_SEP not in name


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting past the parser's depth
        return False
    return True


def read_v3_header(body: str) -> Header:
    """``function<｜tool▁sep｜>NAME`` and a newline, then the opening fence, ```` ```json ````."""
    if not body.startswith(_V3_HEAD):
        return ("partial" if _V3_HEAD.startswith(body) else "bad"), "", 0
    newline = body.find("\n", len(_V3_HEAD))
    if newline < 0:
        return ("bad" if TOOL_SEP in body[len(_V3_HEAD) :] else "partial"), "", 0
    name = body[len(_V3_HEAD) : newline]
    after = body[newline + 1 :]
    if not _good_name(name):
        return "bad", "", 0
    if after.startswith(_V3_FENCE):
        return "ok", name, newline + 1 + len(_V3_FENCE)
    return ("partial" if _V3_FENCE.startswith(after) else "bad"), "", 0


def read_v31_header(body: str) -> Header:
    """``NAME<｜tool▁sep｜>``: the name is all before the first separator, on one line."""
    sep = body.find(TOOL_SEP)
    if sep < 0:
        return ("bad" if "\n" in body else "partial"), "", 0
    name = body[:sep]
    return ("ok", name, sep + len(TOOL_SEP)) if _good_name(name) else ("bad", "", 0)


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3 / R1 (vLLM's ``deepseek_v3``): each call's type (``function``) and name,
    then its arguments in a fenced ``json`` block; the closing fence before the end tag is
    not part of the arguments."""

    name = "deepseek_v3"
    # DeepSeek's tool markers are added tokens its tokenizer does not mark special: decoding
    # keeps them, and vLLM's parser leaves the request's skip_special_tokens alone.
    keeps_special_tokens = False

    def parse(self, text: str) -> ParsedToolCalls:
        return fold_stream(DeepSeekStreamer(read_v3_header, _V3_CLOSE, whole_text=True), text)

    def streamer(self) -> ToolCallStreamer:
        return DeepSeekStreamer(read_v3_header, _V3_CLOSE)


class DeepSeekV31ToolParser(ToolParser):
    """DeepSeek-V3.1 (vLLM's ``deepseek_v31``): each call's name, the separator, then its
    arguments up to the end tag."""

    name = "deepseek_v31"
    keeps_special_tokens = False

    def parse(self, text: str) -> ParsedToolCalls:
        return fold_stream(DeepSeekStreamer(read_v31_header, "", whole_text=True), text)

    def streamer(self) -> ToolCallStreamer:
        return DeepSeekStreamer(read_v31_header, "")


class DeepSeekStreamer(ToolCallStreamer):
    """Modes: "text" (content, holding back a possible section start, and whitespace while
    nothing else came), "section" (between blocks) and "block" (inside a call block, its text
    after the begin tag in ``_body``). ``read_header`` reads a block's header; ``close`` is
    the text that ends the arguments before the end tag (V3's closing fence).

    A block's header goes out once ``read_header`` has it (``whole_text``: only once the
    block has ended, so a call is reported whole or not at all), then its arguments as they
    come, holding back what may still be a marker or the closing fence. A block found bad
    is content from then on, through its end tag."""

    def __init__(
        self, read_header: Callable[[str], Header], close: str, whole_text: bool = False
    ) -> None:
        self._read_header = read_header
        self._close = close
        self._whole_text = whole_text
        self._mode = "text"
        self._pending = ""  # held back: a possible marker's beginning
        self._lead = ""  # whitespace before the section while no other content came
        self._content_sent = False
        self._run = ""  # whitespace between the section's markers, dropped unless text follows
        self._run_is_text = False
        self._body = ""
        self._bad = False  # the current block is no call
        self._said = 0  # how much of the bad block's text went out as content
        self._header: Header | None = None  # the current block's header, once "ok"
        self._header_sent = False
        self._args_sent = 0
        self._num_calls = 0

    def feed(self, text: str) -> list[Delta]:
        out = Deltas()
        handlers = {"text": self._text, "section": self._section, "block": self._block}
        while text:
            text = handlers[self._mode](text, out)
        return out.items

    def finish(self) -> list[Delta]:
        out = Deltas()
        if self._mode == "block":
            self._block("", out, at_end=True)
        if self._mode == "text":
            out.content(self._lead + self._pending)
        elif self._run_is_text:
            out.content(self._pending)
        elif (self._run + self._pending).strip(WHITESPACE):
            out.content(self._run + self._pending)
        self._mode, self._pending, self._lead, self._run = "text", "", "", ""
        return out.items

    def _text(self, text: str, out: Deltas) -> str:
        buf = self._pending + text
        start = buf.find(CALLS_BEGIN)
        if start < 0:
            decided = len(buf) - held_suffix(buf, CALLS_BEGIN)
            self._say(buf[:decided], out)
            self._pending = buf[decided:]
            return ""
        self._say(buf[:start], out)
        # Whitespace alone before the calls is no content (vLLM's message has None).
        self._pending, self._lead, self._mode = "", "", "section"
        return buf[start + len(CALLS_BEGIN) :]

    def _say(self, text: str, out: Deltas) -> None:
        """Content before the section; leading whitespace waits for other text."""
        if self._content_sent:
            out.content(text)
            return
        self._lead += text
        if self._lead.strip(WHITESPACE):
            out.content(self._lead)
            self._lead, self._content_sent = "", True

    def _section(self, text: str, out: Deltas) -> str:
        buf = self._pending + text
        pos, tag = _first(buf, _SECTION_MARKERS)
        run = buf if pos < 0 else buf[:pos]
        decided = len(run) - (held_suffix(run, *_SECTION_MARKERS) if pos < 0 else 0)
        self._pending = run[decided:]
        if self._run_is_text:
            out.content(run[:decided])
        else:
            self._run += run[:decided]
            if self._run.strip(WHITESPACE):
                out.content(self._run)
                self._run, self._run_is_text = "", True
        if pos < 0:
            return ""
        self._pending, self._run, self._run_is_text = "", "", False
        if tag == CALL_BEGIN:
            self._mode, self._body, self._bad, self._said = "block", "", False, 0
            self._header, self._header_sent, self._args_sent = None, False, 0
        return buf[pos + len(tag) :]

    def _block(self, text: str, out: Deltas, at_end: bool = False) -> str:
        body = self._body + text
        end, tag = _first(body, _BLOCK_ENDS, max(0, len(self._body) - _LONGEST_END))
        if end < 0 and not at_end:
            self._body = body
            self._open_block(out)
            return ""
        self._end_block(body if end < 0 else body[:end], tag, out)
        self._mode, self._body = "section", ""
        if end < 0:
            return ""
        return body[end + len(CALL_END) :] if tag == CALL_END else body[end:]

    def _open_block(self, out: Deltas) -> None:
        """A block not ended yet: content if it is bad, else its header and arguments so far."""
        if self._header is None:
            header = self._read_header(self._body)
            self._header = header if header[0] == "ok" else None
        else:
            header = self._header
        state, name, start = header
        if self._bad or state == "bad":
            self._bad = True
            raw = CALL_BEGIN + self._body
            upto = max(self._said, len(raw) - held_suffix(raw, *_BLOCK_ENDS))
            out.content(raw[self._said : upto])
            self._said = upto
        elif state == "ok" and not self._whole_text:
            self._send(name, self._arguments(self._body[start:], ended=False), out)

    def _end_block(self, body: str, marker: str, out: Deltas) -> None:
        """The block's text is all there, ended by ``marker`` (its end tag, or one that cuts
        it off) or by the output's end (no marker)."""
        state, name, start = self._read_header(body)
        if not self._bad and state == "ok":
            arguments = self._arguments(body[start:], ended=bool(marker))
            if marker == CALL_END or self._header_sent or _is_json(arguments):
                self._send(name, arguments, out)
                return
        raw = CALL_BEGIN + body + (CALL_END if marker == CALL_END else "")
        out.content(raw[self._said :])

    def _arguments(self, text: str, ended: bool) -> str:
        """A block's arguments from its text after the header: without the closing fence
        when a marker ``ended`` it, else (still open, or cut off by the output's end) without
        what may still become a marker, after that fence or not."""
        if ended:
            fenced = bool(self._close) and text.endswith(self._close)
            return text[: len(text) - len(self._close)] if fenced else text
        held = held_suffix(text, *_BLOCK_ENDS)
        if self._close:
            held = max(held, held_suffix(text, *(self._close + tag for tag in _BLOCK_ENDS)))
        return text[: len(text) - held]

    def _send(self, name: str, arguments: str, out: Deltas) -> None:
        if not self._header_sent:
            out.header(self._num_calls, make_tool_call_id(), name)
            self._header_sent = True
            self._num_calls += 1
        out.arguments(self._num_calls - 1, arguments[self._args_sent :])
        self._args_sent = max(self._args_sent, len(arguments))
