"""Chat messages in the shape chat templates expect, before any template renders them.

Used by ``LLM.chat`` and by the server's chat, Responses and Messages routes
(``cluster.serving.request_inputs``). An assistant's earlier tool calls reach a template with
each call's ``function.arguments`` an object, Hugging Face's convention and vLLM 0.32's rendering
(Qwen3-Coder's template reads ``arguments|items``; Llama 3.1's ``tojson`` would double-encode
text). Arguments that are no JSON object are ``{}``, as vLLM coerces them, rather than refusing
a conversation whose history holds them. A template that instead joins the arguments to text
(DeepSeek-V3's ``'```json\\n' + arguments``) raises ``TypeError`` on an object; ``rendered``
then renders again with the JSON text the client sent. An
assistant message with an empty ``tool_calls`` list loses the key (a template that tests
``'tool_calls' in message`` would take it for a call).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("llm_cluster.engine")
_Rendered = TypeVar("_Rendered")


def rendered(
    render: Callable[[list[dict[str, Any]]], _Rendered], messages: list[dict[str, Any]]
) -> _Rendered:
    """``render`` (a chat template's) of ``messages`` as ``template_messages`` shapes them; for a
    template that joins a call's arguments to text (a ``TypeError`` on an object), of the
    arguments as the text sent."""
    try:
        return render(template_messages(messages))
    except TypeError:
        return render(template_messages(messages, arguments_as_objects=False))


def template_messages(
    messages: list[dict[str, Any]], arguments_as_objects: bool = True
) -> list[dict[str, Any]]:
    """``messages`` with each assistant's ``tool_calls`` as templates read them (new dicts where
    they change; the caller's are not modified)."""
    return [_assistant_calls(m, arguments_as_objects) if _has_calls(m) else m for m in messages]


def _has_calls(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and message.get("role") == "assistant"
        and isinstance(message.get("tool_calls"), list)
    )


def _assistant_calls(message: dict[str, Any], as_objects: bool) -> dict[str, Any]:
    calls = message["tool_calls"]
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    return {**message, "tool_calls": [_call(c) for c in calls] if as_objects else calls}


def _call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    return {**call, "function": {**function, "arguments": _arguments(function)}}


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    value = function.get("arguments")
    if isinstance(value, dict):
        return value
    if not value:
        return {}
    try:
        parsed = json.loads(value) if isinstance(value, str | bytes) else value
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        logger.warning(
            "tool call %r: arguments are not a JSON object; the template gets {}",
            function.get("name"),
        )
        return {}
    return parsed
