"""Qwen3-Coder's tool calls (vLLM's ``qwen3_coder`` parser), whole or streamed::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Tokyo
    </parameter>
    </function>
    </tool_call>

A ``<tool_call>`` block holds one or more ``<function=NAME>`` ... ``</function>`` calls (a
``<function=`` without the block tag is a call too). A parameter's value is its text less one
leading and one trailing newline, then typed by the schema the request's tool declares for it
(vLLM's ``coerce_to_schema_type``): the types it allows are tried in the order null
(``null``, any case), integer, number (a whole number is an integer; inf/nan are not numbers),
boolean (``true``/``false``/``1``/``0``, any case), object and array (any JSON), string; where
none takes it, it is read as JSON, else kept a string. A parameter the schema does not declare
stays a string. ``arguments`` is ``json.dumps(..., ensure_ascii=False)`` of the parameters;
content around the calls is stripped of surrounding whitespace once a call is made.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from cluster.api.tool_calls import (
    Delta,
    Deltas,
    ParsedToolCalls,
    ToolCallStreamer,
    ToolParser,
    fold_stream,
    held_suffix,
    make_tool_call_id,
)

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
FUNC_START = "<function="
FUNC_END = "</function>"
WHITESPACE = " \t\n\r"
_LOOKBACK = 32  # how far back a parameter's end tag may have begun in an earlier piece
# The format's other tags that end in ">": in a function's name they are text.
_NAME_TAGS = (TOOL_START, TOOL_END, "</parameter>", "<think>", "</think>")

# One parameter: its name, then its value up to its end tag or the next parameter's start.
_PARAM = re.compile(
    r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))", re.DOTALL
)
_PARAM_END = re.compile(r"<\s*/\s*parameter\s*>|<\s*parameter\s*=")
_TYPE_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(
        ("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"),
        "integer",
    ),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))  # fmt: skip


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows: ``type`` (one or a list), the types of its
    ``enum`` values, and those of its ``anyOf``/``oneOf``/``allOf`` choices; string if none."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        for value in enum:
            kinds = [name for kind, name in _ENUM_TYPES if isinstance(value, kind)]
            types.update(kinds[:1] if value is not None else ["null"])
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        if isinstance(choices, list):
            for choice in choices:
                types |= schema_types(choice)
    return types or {"string"}


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def _json(value: str) -> tuple[bool, Any]:
    """(whether ``value`` is JSON without inf/nan, what it reads as)."""
    try:
        parsed = json.loads(value)
        return _finite(parsed), parsed
    except (ValueError, RecursionError):  # too deep: vLLM raises; we keep the text
        return False, None


def convert_value(value: str, schema: Any) -> Any:
    """A parameter's text as the type its schema declares (see the module docstring)."""
    types = {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in schema_types(schema)}
    if "null" in types and value.lower() == "null":
        return None
    if "integer" in types:
        try:
            return int(value)
        except ValueError:
            pass
    if "number" in types:
        try:
            number = float(value)
        except ValueError:
            number = math.inf
        if math.isfinite(number):
            return int(number) if number == int(number) else number
    if "boolean" in types:
        word = value.strip().lower()
        if word in ("true", "1", "false", "0"):
            return word in ("true", "1")
    if types & {"object", "array"}:
        ok, parsed = _json(value)
        if ok:
            return parsed
    if "string" in types:
        return value
    ok, parsed = _json(value)
    return parsed if ok else value


def _trim_newlines(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder's ``<tool_call><function=f><parameter=k>v</parameter></function>`` calls,
    typed by the request's tool schemas. The whole-text split is the stream's, folded."""

    name = "qwen3_coder"
    keeps_special_tokens = True

    def parse(self, text: str) -> ParsedToolCalls:
        return fold_stream(self.streamer(), text)

    def streamer(self) -> ToolCallStreamer:
        return _Qwen3CoderStreamer(self.parameter_schemas)


class _Qwen3CoderStreamer(ToolCallStreamer):
    """Modes: ``text`` (content), ``preamble`` (inside ``<tool_call>``, before a function),
    ``name`` (after ``<function=``), ``args`` (the parameters, up to ``</function>``) and
    ``between`` (after ``</function>``, before ``</tool_call>``). Text in ``preamble`` and
    ``between`` is dropped. A call is announced when its name ends (``>``); each parameter is
    sent once it is closed (its end tag, or the next parameter's start)."""

    def __init__(self, schemas: Mapping[tuple[str, str], Any]) -> None:
        self._schemas = schemas
        self._mode = "text"
        self._buf = ""  # text not decided yet (a tag's beginning, a name, a call's parameters)
        self._held_ws = ""  # whitespace ending the content so far
        self._said = False  # whether any content went out
        self._index = -1
        self._id = ""
        self._name = ""
        self._params_sent = 0
        self._scanned = 0  # where the next parameter's search starts in ``_buf`` (args mode)
        self._seen = 0  # how much of ``_buf`` the last args scan saw

    def feed(self, text: str) -> list[Delta]:
        out = Deltas()
        self._buf += text
        self._run(out, at_end=False)
        return out.items

    def finish(self) -> list[Delta]:
        out = Deltas()
        self._run(out, at_end=True)
        if self._mode == "name":
            self._end_call(out, self._buf)
        elif self._mode == "args":
            self._send_params(self._buf, out, complete=True)
            self._end_call(out, "")
        elif self._mode == "text" and self._buf:
            self._say(self._buf, out)
        self._buf, self._mode = "", "text"
        if self._held_ws and not self._num_calls:
            out.content(self._held_ws)
        self._held_ws = ""
        return out.items

    def _run(self, out: Deltas, at_end: bool) -> None:
        while True:
            mode = self._mode
            step = getattr(self, "_in_" + mode)
            if not step(out, at_end) and self._mode == mode:
                return

    def _find(self, tags: tuple[str, ...], at_end: bool) -> tuple[int, str, int]:
        """The earliest of ``tags`` in the buffer: (where, which, how much of the buffer is
        surely before any tag); which is "" when none is whole."""
        found = [(i, tag) for tag in tags if (i := self._buf.find(tag)) >= 0]
        if found:
            where, tag = min(found)
            return where, tag, where
        held = 0 if at_end else held_suffix(self._buf, *tags)
        return -1, "", len(self._buf) - held

    def _in_text(self, out: Deltas, at_end: bool) -> bool:
        where, tag, safe = self._find((TOOL_START, FUNC_START), at_end)
        self._say(self._buf[:safe], out)
        if not tag:
            self._buf = self._buf[safe:]
            return False
        self._buf = self._buf[where + len(tag) :]
        if tag == TOOL_START:
            self._mode = "preamble"
        else:
            self._start_call()
        return True

    def _in_preamble(self, out: Deltas, at_end: bool) -> bool:
        where, tag, safe = self._find((FUNC_START, TOOL_END), at_end)
        self._buf = self._buf[where + len(tag) :] if tag else self._buf[safe:]
        if tag == FUNC_START:
            self._start_call()
        elif tag == TOOL_END:
            self._mode = "text"
        return bool(tag)

    def _in_between(self, out: Deltas, at_end: bool) -> bool:
        where, tag, safe = self._find((TOOL_END, TOOL_START, FUNC_START), at_end)
        self._buf = self._buf[where + len(tag) :] if tag else self._buf[safe:]
        if tag == TOOL_END:
            self._mode = "text"
        elif tag == TOOL_START:
            self._mode = "preamble"
        elif tag == FUNC_START:
            self._start_call()
        return bool(tag)

    def _in_name(self, out: Deltas, at_end: bool) -> bool:
        seen, self._seen = self._seen, len(self._buf)
        close = self._name_end(seen)
        end = self._buf.find(FUNC_END, max(0, seen - len(FUNC_END)))
        if end >= 0 and (close < 0 or end < close):
            self._end_call(out, self._buf[:end])
            self._buf, self._mode = self._buf[end + len(FUNC_END) :], "between"
            return True
        if close < 0:
            return False
        name = self._buf[:close].strip(WHITESPACE)
        self._buf, self._mode, self._seen = self._buf[close + 1 :], "args", 0
        if name:
            self._announce(name, out)
        else:
            self._name = ""
        return True

    def _name_end(self, start: int) -> int:
        """Where the ``>`` ending a function's name is, from ``start`` on (-1: not come yet).
        As in vLLM's lexer, the ``>`` of a whole other tag (``</tool_call>``, ...) is part of
        the name."""
        close = self._buf.find(">", start)
        while close >= 0 and any(self._buf.endswith(tag, 0, close + 1) for tag in _NAME_TAGS):
            close = self._buf.find(">", close + 1)
        return close

    def _in_args(self, out: Deltas, at_end: bool) -> bool:
        # Only </function> ends the parameters: a </tool_call> in a value is text (as in vLLM).
        # The scans start near where the last one stopped: a long value stays linear.
        seen, self._seen = self._seen, len(self._buf)
        where = self._buf.find(FUNC_END, max(0, seen - len(FUNC_END)))
        if where >= 0:
            body, self._buf = self._buf[:where], self._buf[where + len(FUNC_END) :]
            self._send_params(body, out, complete=True)
            self._end_call(out, "")
            self._mode = "between"
            return True
        # A parameter is sure once a match ends before the buffer's end: a longer buffer
        # can neither end it elsewhere nor hide an end tag inside it. Only new text can end
        # one (an end that began further back is found at the latest at </function>).
        if _PARAM_END.search(self._buf, max(self._scanned, seen - _LOOKBACK)):
            self._send_params(self._buf, out, complete=False)
        return False

    def _send_params(self, body: str, out: Deltas, complete: bool) -> None:
        for match in _PARAM.finditer(body, self._scanned):
            if not complete and match.end() >= len(body):
                break
            self._scanned = match.end()
            if not self._name:
                continue
            key, value = match[1], _trim_newlines(match[2])
            schema = self._schemas.get((self._name, key))
            typed = convert_value(value, schema) if schema is not None else value
            lead = "{" if self._params_sent == 0 else ", "
            text = (
                json.dumps(key, ensure_ascii=False) + ": " + json.dumps(typed, ensure_ascii=False)
            )
            out.arguments(self._index, lead + text)
            self._params_sent += 1

    def _start_call(self) -> None:
        self._mode, self._name, self._params_sent, self._scanned, self._seen = "name", "", 0, 0, 0

    def _announce(self, name: str, out: Deltas) -> None:
        self._index += 1
        self._num_calls += 1
        self._id, self._name = make_tool_call_id(), name
        self._held_ws = self._held_ws if self._said else ""
        out.header(self._index, self._id, name)

    def _end_call(self, out: Deltas, unclosed_name: str) -> None:
        """The call ends: close its arguments; a name that never got its ``>`` (the call
        ended or was cut off inside it) makes a call with no arguments, as in vLLM."""
        if self._mode == "name":
            name = unclosed_name.strip(WHITESPACE)
            if not name:
                return
            self._announce(name, out)
        elif not self._name:
            return
        out.arguments(self._index, "}" if self._params_sent else "{}")
        self._name = ""

    def _say(self, text: str, out: Deltas) -> None:
        """Content, with whitespace at its end held until more content comes; once a call is
        made, whitespace before all content and after all of it is dropped."""
        if not text:
            return
        body = text.rstrip(WHITESPACE)
        if not body:
            self._held_ws += text
            return
        lead = self._held_ws if (self._said or not self._num_calls) else ""
        if not self._said and self._num_calls:
            body = body.lstrip(WHITESPACE)
        out.content(lead + body)
        self._said = True
        self._held_ws = text[len(text.rstrip(WHITESPACE)) :]
