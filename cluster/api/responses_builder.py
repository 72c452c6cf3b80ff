"""A chat result -> a Responses API ``response`` object: its output items (``reasoning``,
``message``, ``function_call``) built from a whole chat message, or from the chat stream's
deltas as OpenAI's event sequence, each event with its ``sequence_number``:

    response.created, response.in_progress
    per item:  response.output_item.added
               message:    response.content_part.added, response.output_text.delta …,
                           response.output_text.done, response.content_part.done
               reasoning:  response.content_part.added, response.reasoning_text.delta …,
                           response.reasoning_text.done, response.content_part.done
               call:       response.function_call_arguments.delta …, …arguments.done
               response.output_item.done
    response.completed (or response.incomplete past max_output_tokens; response.failed
    after an ``error`` event or an aborted generation)

Items follow the order the model wrote them in; a kind of delta other than the open item's
closes it and opens the next. A forced call (``tool_choice`` required or named) comes when the
output ends, as the chat stream it reads sends it (``openai_responses.Completion``): cut off,
it is no call but a message holding the generated text, as the whole response has it."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from cluster.api.responses_models import ResponsesRequest

# The event name of a text item's deltas, by item kind.
_TEXT_EVENT = {"message": "output_text", "reasoning": "reasoning_text"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event as OpenAI sends them: its type named on the ``event:`` line."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class _OpenItem:
    """The output item being streamed: its kind, place, item dict and text so far."""

    def __init__(self, kind: str, index: int, item: dict[str, Any], chat_index: int = -1):
        self.kind, self.index, self.item, self.chat_index = kind, index, item, chat_index
        self.text = ""


class ResponseBuilder:
    """One response as it is built: ``start`` then ``feed`` (chat stream deltas) and ``finish``
    return its events; ``absorb_message`` builds the output of a whole chat message instead.
    ``response()`` is the object at any point (what the events carry, GET returns)."""

    def __init__(self, req: ResponsesRequest, tools: list[dict[str, Any]] | None) -> None:
        self.req = req
        self.id = req.request_id or _new_id("resp")
        self.created_at = int(time.time())
        self.tools = tools or []
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.incomplete_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.input_tokens = 0
        # What the model samples with (StreamStart's: the model's defaults filled in).
        self.temperature: float | None = None
        self.top_p: float | None = None
        self.cached_tokens = 0  # of the input, read from the prefix cache
        self.output_tokens = 0
        self.reasoning_tokens = 0
        self._sequence = 0
        self._open: _OpenItem | None = None

    # ---- the response object ----------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        req = self.req
        text_format = {"type": "text"}
        if req.text is not None and req.text.format is not None:
            text_format = req.text.format.echo()
        usage = None
        if self.status != "in_progress":
            usage = {"input_tokens": self.input_tokens,
                     "input_tokens_details": {"cached_tokens": self.cached_tokens,
                                              "cache_write_tokens": 0},
                     "output_tokens": self.output_tokens,
                     "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                     "total_tokens": self.input_tokens + self.output_tokens}  # fmt: skip
        incomplete = {"reason": self.incomplete_reason} if self.incomplete_reason else None
        reasoning = (req.model_extra or {}).get("reasoning")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "model": req.model, "output": list(self.output),
            "error": self.error, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls
            is not False, "previous_response_id": req.previous_response_id,
            # The values used: the request's, else the model's default, else 1 (OpenAI's).
            "temperature": _first_set(req.temperature, self.temperature, 1.0),
            "top_p": _first_set(req.top_p, self.top_p, 1.0),
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": self.tools, "text": {"format": text_format}, "truncation": "disabled",
            "store": req.store, "user": req.user, "background": False,
            "reasoning": reasoning if isinstance(reasoning, dict) else None,
            "usage": usage,
        }  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]  # fmt: skip

    # ---- a streamed chat message ------------------------------------------------------------

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat ``delta`` (``content``, ``reasoning_content``, ``tool_calls``)."""
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._text_delta("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text_delta("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call_delta(call)
        return events

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            events += self._open_text_item(kind)
        item = self._open
        assert item is not None  # opened above
        item.text += text
        name = f"response.{_TEXT_EVENT[kind]}.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, item_id=item.item["id"], output_index=item.index,
                                  content_index=0, delta=text, **extra))  # fmt: skip
        return events

    def _open_text_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}  # fmt: skip
        else:
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}  # fmt: skip
        self._open = _OpenItem(kind, len(self.output), item)
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=self._open.index,
                            item=dict(item, content=[])),
                self._event("response.content_part.added", item_id=item["id"],
                            output_index=self._open.index, content_index=0,
                            part=_part(kind, ""))]  # fmt: skip

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        open_call = self._open
        if "id" in call or open_call is None or open_call.chat_index != call["index"]:
            events += self._close()
            function = call.get("function", {})
            item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call.get("id") or _new_id("call"),
                    "name": function.get("name", ""), "arguments": ""}  # fmt: skip
            open_call = self._open = _OpenItem("call", len(self.output), item, call["index"])
            self.output.append(item)
            events.append(self._event("response.output_item.added",
                                      output_index=open_call.index, item=dict(item)))  # fmt: skip
        fragment = call.get("function", {}).get("arguments") or ""
        if fragment:
            open_call.text += fragment
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=open_call.item["id"],
                                      output_index=open_call.index, delta=fragment))  # fmt: skip
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The closing events of the open item (none if none is open)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item_id, index = item.item["id"], item.index
        events = []
        if item.kind == "call":
            item.item["arguments"] = item.text
            events.append(self._event("response.function_call_arguments.done", item_id=item_id,
                                      output_index=index, arguments=item.text))  # fmt: skip
        else:
            part = _part(item.kind, item.text)
            item.item["content"] = [part]
            done = f"response.{_TEXT_EVENT[item.kind]}.done"
            extra = {"logprobs": []} if item.kind == "message" else {}
            events += [self._event(done, item_id=item_id, output_index=index, content_index=0,
                                   text=item.text, **extra),
                       self._event("response.content_part.done", item_id=item_id,
                                   output_index=index, content_index=0, part=part)]  # fmt: skip
        item.item["status"] = status
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=dict(item.item)))  # fmt: skip
        return events

    def finish(self, finish_reason: str | None, output_tokens: int) -> list[dict[str, Any]]:
        """The closing events: the open item's, then ``response.completed``
        (``response.incomplete`` when the output hit ``max_output_tokens``,
        ``response.failed`` when the generation was aborted)."""
        self.output_tokens = output_tokens
        events = []
        if not self.output:  # the model wrote nothing: an empty message, as OpenAI sends
            events += self._open_text_item("message")
        events += self._close("completed" if finish_reason not in ("length", "abort")
                              else "incomplete")  # fmt: skip
        self._set_status(finish_reason)
        name = {"incomplete": "response.incomplete", "failed": "response.failed"}
        return events + [self._event(name.get(self.status, "response.completed"),
                                     response=self.response())]  # fmt: skip

    def fail(self, message: str, code: str | None = None) -> list[dict[str, Any]]:
        """The events ending a stream the server could not finish: ``error`` and
        ``response.failed`` (OpenAI's error code set has no room for ours but server_error)."""
        events = self._close("incomplete")
        self.status = "failed"
        self.error = {"code": "server_error", "message": message}
        return events + [self._event("error", code=code, message=message, param=None),
                         self._event("response.failed", response=self.response())]  # fmt: skip

    def _set_status(self, finish_reason: str | None) -> None:
        if finish_reason == "length":
            self.status, self.incomplete_reason = "incomplete", "max_output_tokens"
        elif finish_reason == "abort":  # the replica shut down past its drain
            self.status = "failed"
            self.error = {"code": "server_error", "message": "the server stopped the generation"}
        else:
            self.status = "completed"

    # ---- a whole chat message ---------------------------------------------------------------

    def absorb_message(
        self, message: dict[str, Any], finish_reason: str | None, output_tokens: int
    ) -> None:
        """The output of a whole chat message: its reasoning, its text, its tool calls."""
        item_status = "incomplete" if finish_reason in ("length", "abort") else "completed"
        if message.get("reasoning_content"):
            self.output.append({"id": _new_id("rs"), "type": "reasoning", "summary": [],
                                "content": [_part("reasoning", message["reasoning_content"])],
                                "status": item_status})  # fmt: skip
        calls = message.get("tool_calls") or []
        # As a stream has it: no empty message beside a call or a reasoning item.
        if message.get("content") or not (calls or message.get("reasoning_content")):
            content = [_part("message", message.get("content") or "")]
            self.output.append({"id": _new_id("msg"), "type": "message", "role": "assistant",
                                "status": item_status, "content": content})  # fmt: skip
        for call in calls:
            self.output.append({"id": _new_id("fc"), "type": "function_call",
                                "status": item_status, "call_id": call["id"],
                                "name": call["function"]["name"],
                                "arguments": call["function"]["arguments"]})  # fmt: skip
        self.output_tokens = output_tokens
        self._set_status(finish_reason)


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _first_set(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


__all__ = ["ResponseBuilder", "sse_event"]
