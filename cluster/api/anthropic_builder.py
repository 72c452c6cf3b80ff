"""A chat result -> a Messages API ``message``: its content blocks (``thinking``, ``text``,
``tool_use``) built from the chat stream's deltas as Anthropic's event sequence. A whole
(non-stream) reply is the message those events build, so both have the same blocks:

    message_start                       (the message, no content, usage.input_tokens)
    per block:  content_block_start     (thinking | text | tool_use, empty)
                content_block_delta …   (thinking_delta | text_delta | input_json_delta)
                content_block_stop
    message_delta                       (stop_reason, stop_sequence, usage)
    message_stop

Blocks follow the order the model wrote them in; a kind of delta other than the open block's
closes it and opens the next. A forced call (``tool_choice`` any or tool) comes when the output
ends, as the chat stream it reads sends it (``openai_responses.Completion``): cut off by
``max_tokens``, it is no call but a text block of the generated text, as the chat route
returns it. A stream the server cannot finish ends with an ``error``
event."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from cluster.api.api_errors import anthropic_error

# The delta type and field of a streamed block, by block type.
_DELTA = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
          "tool_use": ("input_json_delta", "partial_json")}  # fmt: skip


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_reason(
    finish_reason: str | None,
    matched: int | str | None,
    stop_sequences: Sequence[str],
    tool_used: bool,
) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a chat finish: ``matched`` is the
    engine's stop reason (the stop string or token id that ended the output)."""
    if finish_reason == "length":
        return "max_tokens", None
    if tool_used:
        return "tool_use", None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def _tool_input(arguments: str) -> Any:
    """A call's arguments as the ``input`` object (text that is no JSON object is kept as
    the raw text under ``"arguments"``: a cut-off call past ``max_tokens``)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": arguments}


def _empty_block(kind: str, name: str = "") -> dict[str, Any]:
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if kind == "tool_use":
        return {"type": "tool_use", "id": _new_id("toolu"), "name": name, "input": {}}
    return {"type": "text", "text": ""}


class MessageBuilder:
    """One message as it is built: ``start`` then ``feed`` (chat stream deltas) and ``finish``
    return its events; ``message()`` is the object at any point."""

    def __init__(self, model: str, stop_sequences: Sequence[str] = ()) -> None:
        self.model = model
        self.stop_sequences = list(stop_sequences)
        self.id = _new_id("msg")
        self.content: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.input_tokens = 0
        # Of those, read from the prefix cache: None unless the model reports them
        # (enable_prompt_tokens_details); Anthropic's input_tokens then leaves them out, as vLLM's.
        self.cache_read_input_tokens: int | None = None
        self.output_tokens = 0
        self._open: dict[str, Any] | None = None  # the block being streamed
        self._open_call = -1  # the chat index of the open tool_use block's call
        self._arguments = ""  # the open tool_use block's input JSON so far

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": list(self.content), "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence,
                "usage": self._usage()}  # fmt: skip

    def _usage(self) -> dict[str, Any]:
        cached = self.cache_read_input_tokens
        if cached is None:
            return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
        return {"input_tokens": max(0, self.input_tokens - cached),
                "cache_read_input_tokens": cached, "output_tokens": self.output_tokens}  # fmt: skip

    # ---- a streamed chat message ------------------------------------------------------------

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self.message()}]

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat ``delta`` (``reasoning_content``, ``content``, ``tool_calls``)."""
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._text_delta("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text_delta("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call_delta(call)
        return events

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._open_block(_empty_block(kind))
        block = self._open
        assert block is not None  # opened above
        block[kind] += text
        return events + [self._delta(text)]

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if "id" in call or self._open is None or self._open_call != call["index"]:
            events += self._close()
            name = call.get("function", {}).get("name", "")
            events += self._open_block(_empty_block("tool_use", name))
            self._open_call = call["index"]
        fragment = call.get("function", {}).get("arguments") or ""
        if fragment:
            self._arguments += fragment
            events.append(self._delta(fragment))
        return events

    def _open_block(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = block
        self.content.append(block)
        return [{"type": "content_block_start", "index": len(self.content) - 1,
                 "content_block": dict(block)}]  # fmt: skip

    def _delta(self, fragment: str) -> dict[str, Any]:
        assert self._open is not None  # a delta belongs to the open block
        kind, field = _DELTA[self._open["type"]]
        return {"type": "content_block_delta", "index": len(self.content) - 1,
                "delta": {"type": kind, field: fragment}}  # fmt: skip

    def _close(self) -> list[dict[str, Any]]:
        """The open block's ``content_block_stop`` (none if none is open)."""
        block, self._open = self._open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = _tool_input(self._arguments)
            self._arguments, self._open_call = "", -1
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def finish(
        self, finish_reason: str | None, matched: int | str | None, output_tokens: int
    ) -> list[dict[str, Any]]:
        """The closing events: the open block's stop, ``message_delta``, ``message_stop``."""
        events = self._close()
        self.output_tokens = output_tokens
        tool_used = any(block["type"] == "tool_use" for block in self.content)
        self.stop_reason, self.stop_sequence = stop_reason(
            finish_reason, matched, self.stop_sequences, tool_used
        )
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return events + [
            {"type": "message_delta", "delta": delta, "usage": dict(self.message()["usage"])},
            {"type": "message_stop"},
        ]

    def fail(self, status: int, message: str, code: str | None = None) -> list[dict[str, Any]]:
        """The event ending a stream the server could not finish: Anthropic's ``error``."""
        return [anthropic_error(status, message, code)[1]]


__all__ = ["MessageBuilder", "stop_reason"]
