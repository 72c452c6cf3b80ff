"""The pieces every tool-call parser is built from (``cluster.api.tool_parsers``) and that the
forced calls reuse (``cluster.api.forced_tool_calls``): the parsed call types, the
``ToolParser`` / ``ToolCallStreamer`` interfaces, the OpenAI ``delta`` dicts a streamer emits
(:data:`Delta`, gathered by ``Deltas``; ``fold_deltas`` puts them back together), and a
streaming scanner of one ``{"name": ..., "arguments": ...}`` object (``CallStream``) whose
argument fragments concatenate to the ``arguments`` the whole text gives.
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

Delta = dict[str, Any]

_ID_ALPHABET = string.ascii_letters + string.digits
WHITESPACE = " \t\n\r"
# Characters that may continue a JSON number or literal (true, false, null); anything else ends it.
_SCALAR_CHARS = frozenset("0123456789+-.eE" + string.ascii_letters)
_ARGUMENT_KEYS = ("arguments", "parameters")


def make_tool_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        """The entry of an OpenAI chat message's ``tool_calls`` list."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedToolCalls:
    """A generated message split into its content (None when empty) and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        """Whether the API should answer with ``finish_reason: "tool_calls"``."""
        return bool(self.tool_calls)


class ToolCallStreamer(ABC):
    """Per-choice state of a streamed message: text deltas in, OpenAI ``delta`` dicts out.
    A streamer counts the calls it announced in ``_num_calls``."""

    _num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[Delta]:
        """Consume the next piece of generated text; return the deltas it decides (maybe none)."""

    @abstractmethod
    def finish(self) -> list[Delta]:
        """The generation ended: flush whatever was held back."""

    @property
    def tools_called(self) -> bool:
        """Whether any tool call has been announced so far."""
        return self._num_calls > 0


class ToolParser(ABC):
    """Reads one model family's tool-call format, for one request: ``parameter_schemas`` maps
    each (function, parameter) to the JSON schema its tools declare for it (a format that
    writes argument values as bare text types them by it: ``qwen3_coder`` by the whole
    schema, ``glm45`` only by whether it is a string or a boolean)."""

    name: ClassVar[str]
    # The format's markers are special tokens: a request this parser reads is decoded with
    # skip_special_tokens=False (as vLLM's parsers adjust such a request).
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(
        self, parameter_schemas: Mapping[tuple[str, str], dict[str, Any]] | None = None
    ) -> None:
        self.parameter_schemas: Mapping[tuple[str, str], dict[str, Any]] = parameter_schemas or {}

    @property
    def string_parameters(self) -> frozenset[tuple[str, str]]:
        """The (function, parameter) pairs the tools declare ``"type": "string"``."""
        schemas = self.parameter_schemas.items()
        return frozenset(key for key, schema in schemas if schema.get("type") == "string")

    @abstractmethod
    def parse(self, text: str) -> ParsedToolCalls:
        """Split a whole generated message into content and tool calls."""

    @abstractmethod
    def streamer(self) -> ToolCallStreamer:
        """A fresh streamer for one choice of one request."""


def fold_deltas(deltas: Iterable[Delta]) -> ParsedToolCalls:
    """The message a client assembles from streamed deltas, as :meth:`ToolParser.parse` gives it."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        content.append(delta.get("content") or "")
        for entry in delta.get("tool_calls", ()):
            if "id" in entry:
                calls[entry["index"]] = [entry["id"], entry["function"]["name"], ""]
            calls[entry["index"]][2] += entry["function"]["arguments"]
    tool_calls = [ToolCall(name, arguments, call_id) for call_id, name, arguments in calls.values()]
    return ParsedToolCalls("".join(content) or None, tool_calls)


def fold_stream(streamer: ToolCallStreamer, text: str) -> ParsedToolCalls:
    """The split a streamer gives ``text`` fed whole: a parser defined by its stream."""
    return fold_deltas(streamer.feed(text) + streamer.finish())


class Deltas:
    """Deltas of one feed; consecutive content, or arguments of one call, merge into one."""

    def __init__(self) -> None:
        self.items: list[Delta] = []

    def content(self, text: str) -> None:
        if not text:
            return
        if self.items and "content" in self.items[-1]:
            self.items[-1]["content"] += text
        else:
            self.items.append({"content": text})

    def reasoning(self, text: str) -> None:
        """A reasoning model's reasoning, in the order it came (harmony's analysis channel)."""
        if not text:
            return
        if self.items and "reasoning_content" in self.items[-1]:
            self.items[-1]["reasoning_content"] += text
        else:
            self.items.append({"reasoning_content": text})

    def header(self, index: int, call_id: str, name: str) -> None:
        function = {"name": name, "arguments": ""}
        entry = {"index": index, "id": call_id, "type": "function", "function": function}
        self.items.append({"tool_calls": [entry]})

    def arguments(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        last = self.items[-1]["tool_calls"][0] if self.items else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += fragment
        else:
            self.items.append(
                {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}
            )


class JsonNesting:
    """JSON bracket depth and string state, across characters fed one at a time."""

    __slots__ = ("depth", "escaped", "in_string")

    def __init__(self, in_string: bool = False) -> None:
        self.depth = 0
        self.in_string = in_string
        self.escaped = False

    def step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1


class _CallScanner:
    """Reads one call object, ``{"name": "f", "arguments": {...}}``, a character at a time.

    The first ``name`` must be a string and the first ``arguments``/``parameters`` an object or
    a string; ``arguments`` is that value's JSON text as written (a string stays a JSON string,
    as vLLM's ``json.dumps`` of it gives), growing while it arrives. Every value is checked
    with ``json.loads`` once it ends, so ``done`` means the object is valid JSON. A character
    the object cannot take is refused, not consumed; a value that ends malformed sets ``error``
    with its last character consumed.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments_kind: str | None = None  # "object" or "string", once its value starts
        self.arguments_text = ""  # raw JSON text of the arguments value, so far
        self.done = False
        self.error = False
        self._state = "start"
        self._key: str | None = None
        self._target = "other"  # what the current value is: "name", "arguments" or "other"
        self._raw = ""  # raw text of the current key or value
        self._nesting = JsonNesting()

    @property
    def arguments(self) -> str:
        return self.arguments_text if self.arguments_kind is not None else "{}"

    def feed(self, text: str) -> int:
        """Consume ``text`` up to the end of the object or an error; return how many characters
        were consumed."""
        for i, ch in enumerate(text):
            if self.done or self.error:
                return i
            if not self._step(ch):
                return i + 1 if self._state == "ended_bad" else i
        return len(text)

    def _step(self, ch: str) -> bool:
        state = self._state
        if state in ("container", "string"):
            return self._step_value(ch)
        if state == "scalar":
            if ch in _SCALAR_CHARS:
                self._raw += ch
                return True
            if not self._end_value():
                return False
            return self._step(ch)
        if state == "key":
            return self._step_key(ch)
        if ch in WHITESPACE:
            return True
        if state == "start" and ch == "{":
            self._state = "first_key"
        elif state in ("first_key", "key_expected") and ch == '"':
            self._state, self._raw, self._nesting = "key", "", JsonNesting(in_string=True)
        elif state in ("first_key", "after_value") and ch == "}":
            return self._close()
        elif state == "colon" and ch == ":":
            self._state = "value"
        elif state == "after_value" and ch == ",":
            self._state = "key_expected"
        elif state == "value":
            return self._start_value(ch)
        else:
            return self._refuse()
        return True

    def _step_key(self, ch: str) -> bool:
        self._nesting.step(ch)
        if self._nesting.in_string:
            self._raw += ch
            return True
        try:
            self._key = json.loads('"' + self._raw + '"')
        except (ValueError, RecursionError):
            return self._refuse()
        self._state = "colon"
        return True

    def _start_value(self, ch: str) -> bool:
        if self._key == "name" and self.name is None:
            self._target = "name"
        elif self._key in _ARGUMENT_KEYS and self.arguments_kind is None:
            self._target = "arguments"
        else:
            self._target = "other"
        self._raw, self._nesting = "", JsonNesting()
        if ch == '"':
            self._state = "string"
        elif (ch == "{" and self._target != "name") or (ch == "[" and self._target == "other"):
            self._state = "container"
        elif ch in _SCALAR_CHARS and self._target == "other":
            self._state, self._raw = "scalar", ch
            return True
        else:
            return self._refuse()
        if self._target == "arguments":
            self.arguments_kind = "object" if ch == "{" else "string"
        return self._step_value(ch)

    def _step_value(self, ch: str) -> bool:
        self._nesting.step(ch)
        self._raw += ch
        if self._target == "arguments":
            self.arguments_text += ch
        if self._nesting.in_string or self._nesting.depth > 0:
            return True
        if self._end_value():
            return True
        self._state = "ended_bad"  # the value's last character is consumed, then refused
        return False

    def _end_value(self) -> bool:
        try:
            value = json.loads(self._raw)
        except (ValueError, RecursionError):  # RecursionError: nested past json's depth
            return self._refuse()
        if self._target == "name":
            self.name = value
        self._state = "after_value"
        return True

    def _close(self) -> bool:
        if self.name is None:
            return self._refuse()
        self.done = True
        return True

    def _refuse(self) -> bool:
        self.error = True
        return False


class CallStream:
    """One call's deltas: its header once it is sure to be a call, then its arguments.

    When the header goes out: ``eager_header`` (a schema-constrained output, which cannot go
    wrong) with the name; by default with the first character of the arguments (or the
    object's end), so that an object with a name but no usable arguments can still fall back
    to content; ``whole_text`` (the text is all there, as :meth:`ToolParser.parse` has it) only
    once the object is whole and valid, so a malformed call is never reported. The header is
    decided after a feed's text is scanned: a call that goes wrong within the feed that would
    have announced it is no call.
    """

    def __init__(self, index: int, eager_header: bool = False, whole_text: bool = False) -> None:
        self.index = index
        self.id = make_tool_call_id()
        self.scanner = _CallScanner()
        self.header_sent = False
        self._eager_header = eager_header
        self._whole_text = whole_text
        self._sent = 0

    def feed(self, text: str, out: Deltas) -> int:
        consumed = self.scanner.feed(text)
        scanner = self.scanner
        if not self.header_sent:
            if self._whole_text:
                known = scanner.done
            else:
                known = scanner.arguments_kind is not None or scanner.done or self._eager_header
            if scanner.error or scanner.name is None or not known:
                return consumed
            out.header(self.index, self.id, scanner.name)
            self.header_sent = True
        if scanner.done and scanner.arguments_kind is None:
            out.arguments(self.index, scanner.arguments[self._sent :])
            self._sent = len(scanner.arguments)
        else:
            out.arguments(self.index, scanner.arguments_text[self._sent :])
            self._sent = len(scanner.arguments_text)
        return consumed


def held_suffix(text: str, *tags: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of one of ``tags``: text
    a stream holds back, as it may still become a tag."""
    window = text[-max(len(tag) for tag in tags) :]
    if not any(tag[0] in window for tag in tags):
        return 0  # the usual case, decided fast
    held = 0
    for tag in tags:
        for length in range(min(len(tag) - 1, len(text)), held, -1):
            if text.endswith(tag[:length]):
                held = length
                break
    return held
