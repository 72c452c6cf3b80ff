"""Tool calls the API forces (``tool_choice`` naming a function, or ``"required"``): the JSON
schema that constrains the output (:func:`named_tool_schema`, :func:`required_tools_schema`) and
the streamers that read it (:class:`NamedToolCallStreamer`, :class:`RequiredToolCallStreamer`),
built on ``cluster.api.tool_parsers``' streaming pieces."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cluster.api.api_errors import APIError
from cluster.api.tool_calls import (
    WHITESPACE,
    CallStream,
    Delta,
    Deltas,
    JsonNesting,
    ParsedToolCalls,
    ToolCallStreamer,
    fold_stream,
    make_tool_call_id,
)


class NamedToolCallStreamer(ToolCallStreamer):
    """A call forced by name (``tool_choice: {"type": "function", "function": {"name": f}}``):
    the whole output, constrained by :func:`named_tool_schema`, is the arguments object."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._id = make_tool_call_id()
        self._started = False
        self._nesting = JsonNesting()
        self._done = False

    @property
    def tools_called(self) -> bool:
        return self._started

    def feed(self, text: str) -> list[Delta]:
        out = Deltas()
        if not self._started:
            text = text.lstrip(WHITESPACE)
            if text:
                self._start(out)
        end = 0
        while end < len(text) and not self._done:
            self._nesting.step(text[end])
            end += 1
            self._done = self._nesting.depth == 0 and not self._nesting.in_string
        out.arguments(0, text[:end])
        return out.items

    def finish(self) -> list[Delta]:
        out = Deltas()
        if not self._started:
            self._start(out)
        return out.items

    def _start(self, out: Deltas) -> None:
        out.header(0, self._id, self.name)
        self._started = True


class RequiredToolCallStreamer(ToolCallStreamer):
    """Calls forced by ``tool_choice: "required"``: the output, constrained by
    :func:`required_tools_schema`, is ``[{"name": "f", "parameters": {...}}, ...]``. A call is
    announced as soon as its name is whole; its parameters then stream as they arrive."""

    def __init__(self) -> None:
        self._mode = "start"  # "start", "element", "call", "after_call", "done"
        self._call = CallStream(0, eager_header=True)
        self._num_calls = 0

    def feed(self, text: str) -> list[Delta]:
        out = Deltas()
        while text and self._mode != "done":
            text = self._step(text, out)
        return out.items

    def finish(self) -> list[Delta]:
        self._mode = "done"
        return []

    def _step(self, text: str, out: Deltas) -> str:
        if self._mode == "call":
            call = self._call
            consumed = call.feed(text, out)
            if call.header_sent and call.index == self._num_calls:
                self._num_calls += 1
            if call.scanner.error:
                self._mode = "done"
            elif call.scanner.done:
                self._mode = "after_call"
            return text[consumed:]
        rest = text.lstrip(WHITESPACE)
        if not rest:
            return ""
        first = rest[0]
        if self._mode == "start" and first == "[":
            self._mode = "element"
        elif self._mode == "element" and first == "{":
            self._call = CallStream(self._num_calls, eager_header=True)
            self._mode = "call"
            return rest
        elif self._mode == "after_call" and first == ",":
            self._mode = "element"
        else:
            # "]", or output the schema would not have allowed: nothing more is read.
            self._mode = "done"
        return rest[1:]


def parse_named_tool_call(name: str, text: str) -> ParsedToolCalls:
    """The whole output of a call forced by name (see :class:`NamedToolCallStreamer`)."""
    return fold_stream(NamedToolCallStreamer(name), text)


def parse_required_tool_calls(text: str) -> ParsedToolCalls:
    """The whole output of ``tool_choice: "required"`` (see :class:`RequiredToolCallStreamer`)."""
    return fold_stream(RequiredToolCallStreamer(), text)


def tool_function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function of an OpenAI tool, ``{"type": "function", "function": {...}}``, or of a bare
    function dict (the API's models checked that it has a name)."""
    return tool.get("function", tool)


def find_tool(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    """The tool whose function is called ``name``: the API's ``tool_choice`` check (a 400 on
    ``tool_choice.function.name``) made sure there is one."""
    return next(tool for tool in tools if tool_function(tool)["name"] == name)


def named_tool_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """JSON schema of the output of a call forced by name: the tool's arguments object."""
    parameters = tool_function(tool).get("parameters")
    # No parameters (or an empty schema): the arguments of no parameters, ``{}`` (vLLM's
    # ``{"properties": {}}``, which the grammar closes to other keys).
    return dict(parameters) if parameters else {"type": "object", "properties": {}}


def required_tools_schema(
    tools: Sequence[Mapping[str, Any]], parallel_tool_calls: bool = True
) -> dict[str, Any]:
    """JSON schema of the output of ``tool_choice: "required"``: a non-empty array of calls, each
    ``{"name": <one of the tools>, "parameters": <that tool's arguments>}``; at most one call when
    ``parallel_tool_calls`` is False. ``tools`` is not empty: the API's ``tool_choice`` check (a
    400 on ``tool_choice``) refused "required" without tools.

    A tool's parameters sit deep in this schema, but their ``$ref``s point from the root
    (``#/$defs/Unit``, as pydantic writes them): each tool's ``$defs`` and ``definitions`` move
    to the root, shared by all the tools (as vLLM does); a name two tools define differently is
    a 400."""
    shared: dict[str, dict[str, Any]] = {keyword: {} for keyword in _DEFINITIONS}
    calls = []
    for i, tool in enumerate(tools):
        parameters = named_tool_schema(tool)
        for keyword, defs in shared.items():
            _hoist(parameters.pop(keyword, None), defs, f"tools.{i}.function.parameters.{keyword}")
        name = {"enum": [tool_function(tool)["name"]]}
        calls.append(
            {
                "type": "object",
                "properties": {"name": name, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update((keyword, defs) for keyword, defs in shared.items() if defs)
    return schema


# Where a schema keeps the subschemas its ``$ref``s name (2020-12's name, then draft 7's).
_DEFINITIONS = ("$defs", "definitions")


def _hoist(defs: Any, shared: dict[str, Any], param: str) -> None:
    """Add one tool's ``defs`` to those of all the tools (``shared``)."""
    if defs is None:
        return
    if not isinstance(defs, dict):
        raise APIError(400, f"{param}: must be an object of schemas, got {type(defs).__name__}",
                       param)  # fmt: skip
    for name, schema in defs.items():
        if name in shared and shared[name] != schema:
            raise APIError(400, f"{param}.{name}: another tool defines {name!r} differently; "
                           'the tools of tool_choice "required" share one namespace of '
                           "definitions", f"{param}.{name}")  # fmt: skip
        shared[name] = schema
