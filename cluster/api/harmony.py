"""Reading gpt-oss's output, OpenAI's harmony format, by channel. Written from the published
specification (openai/harmony ``docs/format.md``), not with the ``openai-harmony`` package,
which downloads its o200k encoding at run time: the reader works on the text a harmony chat is
decoded to with its special tokens kept (the front asks for ``skip_special_tokens=False``).

The output continues the generation prompt ``<|start|>assistant``, so its first header has no
role. Each message is a header, ``<|message|>``, and its text up to ``<|end|>`` (or the stop
token, ``<|return|>`` / ``<|call|>``, which the engine leaves out of the text); messages follow
each other without separators (one per line here)::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>

A message's header (its recipient ``to=…`` in the role or the channel part) decides what its
text is, as a :class:`Piece` kind (the class lists them: reasoning, call, arguments, content).

Output that does not start like a header is content (a grammar forced plain text or JSON from
its first token). Text is passed on as it arrives: only what may be the beginning of a special
token is held back until more text decides it, and a header until its ``<|message|>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from engine.harmony_template import (  # the format's special tokens, defined once
    CALL,
    CONSTRAIN,
    END,
    HARMONY_TOKENS,
    MESSAGE,
    RETURN,
    START,
)

# A message's text ends at these (a <|start|> without an <|end|> before it too).
_TEXT_ENDS = (END, RETURN, CALL, START)
_HEADER_ENDS = (MESSAGE, START, END, RETURN, CALL)
_ROLE = re.compile(r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]*)")
FUNCTIONS = "functions."
# Recipients that are no function (vLLM's ``is_function_recipient``): the assistant itself and
# harmony's built-in tools, by the first dot-separated part (``browser.search``).
_NOT_FUNCTIONS = frozenset({"assistant", "python", "browser", "container"})

PieceKind = Literal["reasoning", "content", "call", "arguments"]


@dataclass(frozen=True)
class Piece:
    """What a stretch of output is: reasoning, content, a call's function name (once, as its
    header is read), or a fragment of the call's arguments.

    A message's header (its recipient ``to=…`` in the role or the channel part) decides what its
    text is, as a kind:

        channel analysis              "reasoning"
        recipient functions.NAME,     "call" (NAME) then "arguments" (the JSON as written); with
        or a bare NAME                calls not read (a chat without tools), "content"
        final, commentary (preamble)  "content"
        another recipient or role     dropped (no built-in tools are offered)

    A bare NAME (``to=get_weather``: gpt-oss sometimes leaves the prefix out) is a function
    unless it is ``assistant`` or a built-in tool (``python``, ``browser.*``, ``container.*``),
    as in vLLM's chat path; ``functions.`` with no name is no call.
    """

    kind: PieceKind
    text: str


class HarmonyReader:
    """One output's reader: ``feed`` text as it arrives, then ``finish``; each returns the
    pieces it decided. ``read_calls`` False: calls to functions are read as content."""

    def __init__(self, read_calls: bool = True) -> None:
        self.read_calls = read_calls
        self._mode: Literal["header", "text", "between"] = "header"
        self._header = ""  # the header so far
        self._role_known = True  # the prompt wrote the first message's role
        self._may_be_plain = True  # until the first header shows it is one
        self._kind: PieceKind | None = None  # the current message's text (None: dropped)
        self._arguments_sent = False
        self._held = ""  # text that may begin a special token

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        text, self._held = self._held + text, ""
        while text:
            if self._mode == "header":
                text = self._read_header(text, out)
            elif self._mode == "text":
                text = self._read_text(text, out)
            else:
                text = self._read_between(text)
        return out

    def finish(self) -> list[Piece]:
        """The output ended: held-back text was no special token after all; a header that never
        reached ``<|message|>`` is dropped."""
        out: list[Piece] = []
        if self._mode == "text":
            self._emit(self._held, out)
            self._end_message(out)
        self._held, self._header, self._mode = "", "", "between"
        return out

    def _read_header(self, text: str, out: list[Piece]) -> str:
        header = self._header + text
        self._header = ""
        if self._may_be_plain:
            start = header.lstrip()
            if not start or any(p.startswith(start) for p in ("<|", "to=")):
                self._header = header  # undecided
                return ""
            self._may_be_plain = False
            if not start.startswith(("<|", "to=")):
                self._kind, self._mode = "content", "text"
                return header
        found = _first_of(header, _HEADER_ENDS)
        if found is None:
            self._header = header
            return ""
        at, token = found
        rest = header[at + len(token) :]
        if token == MESSAGE:
            self._open_message(header[:at], out)
            self._mode = "text"
        elif token == START:  # a new message before this header ended: read that one
            self._role_known = False
        else:  # a header cut short by an end: no message
            self._mode = "between"
        return rest

    def _open_message(self, header: str, out: list[Piece]) -> None:
        role = "assistant"
        if not self._role_known:
            match = _ROLE.match(header)
            role = match.group(1) if match else ""
            header = header[match.end() :] if match else header
        self._role_known = True
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        function = _function_name(recipient.group(1)) if recipient is not None else None
        self._arguments_sent = False
        if role != "assistant":
            self._kind = None
        elif function is not None:
            if self.read_calls:
                out.append(Piece("call", function))
                self._kind = "arguments"
            else:
                self._kind = "content"
        elif recipient is not None:
            self._kind = None
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _read_text(self, text: str, out: list[Piece]) -> str:
        found = _first_of(text, _TEXT_ENDS)
        if found is None:
            keep = _partial_token_len(text)
            self._emit(text[: len(text) - keep], out)
            self._held = text[len(text) - keep :]
            return ""
        at, token = found
        self._emit(text[:at], out)
        self._end_message(out)
        if token == START:
            self._mode, self._role_known = "header", False
        else:
            self._mode = "between"
        return text[at + len(token) :]

    def _read_between(self, text: str) -> str:
        """After a message: the next ``<|start|>``; anything else is outside every message."""
        at = text.find(START)
        if at < 0:
            keep = _partial_token_len(text)
            self._held = text[len(text) - keep :]
            return ""
        self._mode, self._role_known = "header", False
        return text[at + len(START) :]

    def _emit(self, text: str, out: list[Piece]) -> None:
        if not text or self._kind is None:
            return
        if self._kind == "arguments":
            self._arguments_sent = True
        if out and out[-1].kind == self._kind:
            out[-1] = Piece(self._kind, out[-1].text + text)
        else:
            out.append(Piece(self._kind, text))

    def _end_message(self, out: list[Piece]) -> None:
        if self._kind == "arguments" and not self._arguments_sent:
            out.append(Piece("arguments", "{}"))  # a call of no arguments
        self._kind = None


def _function_name(recipient: str) -> str | None:
    """The function a message's recipient calls (``functions.NAME`` or a bare ``NAME``), or
    None when it calls none (``functions.`` alone, ``assistant``, a built-in tool)."""
    if recipient.startswith(FUNCTIONS):
        return recipient[len(FUNCTIONS) :] or None
    if recipient.split(".", 1)[0] in _NOT_FUNCTIONS:
        return None
    return recipient


def _first_of(text: str, tokens: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(at, token) for token in tokens if (at := text.find(token)) >= 0]
    return min(found) if found else None


def _partial_token_len(text: str) -> int:
    """The length of the end of ``text`` that is a proper beginning of a special token (each
    has one ``<``, its first character: only the text from the last ``<`` can be one)."""
    at = text.rfind("<", max(0, len(text) - len(CONSTRAIN) + 1))
    if at >= 0 and any(token.startswith(text[at:]) for token in HARMONY_TOKENS):
        return len(text) - at
    return 0


def reasoning_spans(text: str) -> list[tuple[int, int]]:
    """The character spans of a whole output's message texts that vLLM counts as reasoning
    tokens (``usage.output_tokens_details.reasoning_tokens``): those on the analysis channel,
    and those on commentary to a recipient (a call's arguments). Headers and special tokens
    are not counted; plain output (no header) has none."""
    if not text.lstrip().startswith(("<|", "to=")):
        return []
    spans, at = [], 0
    while (opened := text.find(MESSAGE, at)) >= 0:
        header, start = text[at:opened], opened + len(MESSAGE)
        found = _first_of(text[start:], _TEXT_ENDS)
        end = len(text) if found is None else start + found[0]
        channel = _CHANNEL.search(header)
        name = channel.group(1) if channel is not None else None
        if name == "analysis" or (name == "commentary" and _RECIPIENT.search(header)):
            spans.append((start, end))
        at = text.find(START, end)
        if at < 0:
            break
        at += len(START)
    return spans


def read_harmony(text: str, read_calls: bool = True) -> list[Piece]:
    """The pieces of a whole output: those of the stream, text fed at once."""
    reader = HarmonyReader(read_calls)
    return reader.feed(text) + reader.finish()
