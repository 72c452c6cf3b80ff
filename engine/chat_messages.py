"""Chat messages in the shape chat templates expect, before any template renders them.

Used by ``LLM.chat`` and by the server's chat, Responses and Messages routes
(``cluster.serving.request_inputs``). An assistant's earlier tool calls reach a template as
Hugging Face's templates read them: each call's ``function.arguments`` an object, not the JSON
text OpenAI sends, and an assistant message with an empty ``tool_calls`` list without the key
(a template that tests ``'tool_calls' in message`` would take it for a call); a null
``content`` (an assistant's turn of calls only) is empty text, never ``None``. vLLM 0.32 does
the same (``_postprocess_messages``, its content parsing), and coerces arguments that are not a
JSON object to ``{}`` rather than refusing a conversation whose history holds them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger("llm_cluster.engine")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each assistant's ``tool_calls`` as templates read them, and a null
    ``content`` as empty text (new dicts where they change; the caller's are not modified)."""
    return [_texts(_assistant_calls(m) if _has_calls(m) else m) for m in messages]


def _texts(message: Any) -> Any:
    if isinstance(message, dict) and "content" in message and message["content"] is None:
        return {**message, "content": ""}  # a template that checks its type refuses None
    return message


def _has_calls(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and message.get("role") == "assistant"
        and isinstance(message.get("tool_calls"), list)
    )


def _assistant_calls(message: dict[str, Any]) -> dict[str, Any]:
    calls = message["tool_calls"]
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    return {**message, "tool_calls": [_call(c) for c in calls]}


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
