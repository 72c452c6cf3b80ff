"""Kimi K2 (Moonshot) tool calls, as vLLM's ``kimi_k2`` parser reads them. The model writes its
calls in one section of special tokens, after any content::

    Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Tokyo"}<|tool_call_end|><|tool_calls_section_end|>

The header before ``<|tool_call_argument_begin|>`` is the call's id as the model writes it
(``functions.NAME:INDEX``); the name is its part before the first ``:``, less ``functions.``. A
header that is no such id is no call. The arguments are the text up to ``<|tool_call_end|>`` (or
the section's end), stripped, ``{}`` when empty, taken as written (not checked as JSON). Content
is the text before the section, with the other markers kept verbatim; whitespace-only content
is dropped once a call begins. From the section on, text outside the calls is not content (vLLM
drops it too, and reads a later section's calls). The whole-text split is the stream's, folded.
"""

from __future__ import annotations

import re

from cluster.api.tool_calls import (
    Delta,
    Deltas,
    ParsedToolCalls,
    ToolCallStreamer,
    ToolParser,
    fold_stream,
    held_suffix,
)

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

# The markers each mode reads; any other text (other markers included) is that mode's text.
_HEADER_MARKERS = (SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
_ARGUMENT_MARKERS = (SECTION_END, CALL_BEGIN, CALL_END)
_SECTION_MARKERS = (CALL_BEGIN,)
_CONTENT_MARKERS = (SECTION_BEGIN,)
_CALL_ID = re.compile(r".+:\d+")


def read_call_header(header: str) -> tuple[str, str] | None:
    """The (id, name) a call's header gives: its beginning through the last ``:DIGITS`` on its
    first line, and that id's part before the first ``:`` less ``functions.``; None when the
    header has no such id or the name is empty."""
    match = _CALL_ID.match(header.strip())
    if match is None:
        return None
    call_id = match[0].strip()
    name = call_id.split(":")[0].removeprefix("functions.")
    return (call_id, name) if name else None


def _find_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The first of ``markers`` in ``text``, with where it starts."""
    found = [(at, marker) for marker in markers if (at := text.find(marker)) >= 0]
    return min(found) if found else None


class KimiK2ToolParser(ToolParser):
    """Kimi K2: calls in a ``<|tool_calls_section_begin|>`` section, each with its id as header
    (see the module's docstring)."""

    name = "kimi_k2"
    keeps_special_tokens = True

    def parse(self, text: str) -> ParsedToolCalls:
        return fold_stream(self.streamer(), text)

    def streamer(self) -> ToolCallStreamer:
        return _KimiK2Streamer()


class _KimiK2Streamer(ToolCallStreamer):
    """Modes: "content" (before the section), "section" (in or after a section, outside a call:
    dropped), "header" (a call's header, held until it ends) and "arguments" (sent as they
    arrive, less their leading and trailing whitespace). A possible marker's beginning at the
    end of a feed is held until the next feed decides it."""

    def __init__(self) -> None:
        self._mode = "content"
        self._pending = ""  # held: the beginning of a possible marker
        self._lead = ""  # content that is whitespace only so far: held, dropped if a call begins
        self._content_sent = False
        self._header = ""
        self._index: int | None = None  # the current call's index; None when it is no call
        self._arguments_sent = False
        self._gap = ""  # the current call's trailing whitespace, held
        self._num_calls = 0

    def feed(self, text: str) -> list[Delta]:
        out = Deltas()
        text = self._pending + text
        self._pending = ""
        while text:
            markers = self._markers()
            found = _find_marker(text, markers)
            if found is None:
                held = held_suffix(text, *markers)
                self._text(text[: len(text) - held], out)
                self._pending = text[len(text) - held :]
                break
            at, marker = found
            self._text(text[:at], out)
            self._marker(marker, out)
            text = text[at + len(marker) :]
        return out.items

    def finish(self) -> list[Delta]:
        out = Deltas()
        pending, self._pending = self._pending, ""
        self._text(pending, out)
        if self._mode in ("header", "arguments"):
            self._end_call(out)
        out.content(self._lead)
        self._mode, self._lead = "section", ""
        return out.items

    def _markers(self) -> tuple[str, ...]:
        return {
            "content": _CONTENT_MARKERS,
            "section": _SECTION_MARKERS,
            "header": _HEADER_MARKERS,
            "arguments": _ARGUMENT_MARKERS,
        }[self._mode]

    def _text(self, text: str, out: Deltas) -> None:
        if self._mode == "content":
            self._content(text, out)
        elif self._mode == "header":
            self._header += text
        elif self._mode == "arguments":
            self._arguments(text, out)

    def _marker(self, marker: str, out: Deltas) -> None:
        mode = self._mode
        if mode == "content":
            self._mode = "section"
        elif mode == "header" and marker == ARGUMENT_BEGIN:
            self._announce(out)
            self._mode = "arguments"
        elif mode in ("header", "arguments"):
            # A marker that ends the call (a header ended by any but the arguments' start is
            # a call without arguments); a call's begin ends the one before it too, where vLLM
            # reads it, and the next call, as text of the first.
            self._end_call(out)
            self._mode = "section"
        if marker == CALL_BEGIN:
            self._lead = ""
            self._header, self._index, self._mode = "", None, "header"

    def _content(self, text: str, out: Deltas) -> None:
        if self._content_sent:
            out.content(text)
            return
        self._lead += text
        if self._lead.strip():
            out.content(self._lead)
            self._content_sent, self._lead = True, ""

    def _announce(self, out: Deltas) -> None:
        """The header is whole: the call goes out if it is one."""
        read = read_call_header(self._header)
        self._arguments_sent, self._gap = False, ""
        if read is None:
            self._index = None
            return
        call_id, name = read
        self._index = self._num_calls
        self._num_calls += 1
        out.header(self._index, call_id, name)

    def _arguments(self, text: str, out: Deltas) -> None:
        if self._index is None:
            return
        if not self._arguments_sent:
            text = text.lstrip()
            if not text:
                return
        body = self._gap + text
        kept = body.rstrip()
        self._gap = body[len(kept) :]
        if kept:
            out.arguments(self._index, kept)
            self._arguments_sent = True

    def _end_call(self, out: Deltas) -> None:
        if self._mode == "header":
            self._announce(out)
        if self._index is not None and not self._arguments_sent:
            out.arguments(self._index, "{}")
        self._index, self._header, self._gap = None, "", ""
