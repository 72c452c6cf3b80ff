"""A Responses API request -> the chat request the chat route serves (``ChatCompletionRequest``):
``instructions`` and ``input`` items become chat messages, function ``tools`` and
``tool_choice`` the chat ones, ``text.format`` the chat ``response_format``. The chat path then
does the rest (template, tool parsers, structured outputs), so both routes generate alike.

A conversation (``previous_response_id``) is a list of items: the earlier requests' input items
and the output items of their responses, then this request's input. ``instructions`` are not
part of it (OpenAI's rule: a request's instructions apply to that request only)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from cluster.api.api_errors import APIError
from cluster.api.openai_models import ChatCompletionRequest
from cluster.api.openai_payloads import (
    UNSUPPORTED_FIELDS,
    Unsupported,
    check_extra_fields,
    image_part,
)
from cluster.api.responses_models import SAMPLING_PASSTHROUGH, ResponsesRequest

_NO_TEMPLATE = "request-supplied chat templates are not accepted; the model's own template is used"
# Undeclared fields that would change the output and are not supported (``check_extra_fields``).
# Others (``reasoning``, ``service_tier``, ``prompt_cache_key``, ...) are ignored, as on the
# chat route; ``include`` is checked on its own (``_check_include``).
UNSUPPORTED_RESPONSE_FIELDS = {
    "background": Unsupported("background responses are not supported; use stream", (False,)),
    "conversation": Unsupported("the Conversations API is not supported; use previous_response_id"),
    "prompt": Unsupported("stored prompt templates are not supported; send instructions and input"),
    "max_tool_calls": Unsupported("not supported"),
    "context_management": Unsupported("not supported"),
    "chat_template": Unsupported(_NO_TEMPLATE),
    "include_reasoning": Unsupported(
        "not supported; the reasoning item is always returned", (True,)
    ),
    "vllm_xargs": Unsupported("not supported", ({},)),
    "mm_processor_kwargs": UNSUPPORTED_FIELDS["mm_processor_kwargs"],
    "kv_transfer_params": UNSUPPORTED_FIELDS["kv_transfer_params"],
}
# Tool types OpenAI runs itself (search, code, computer, images, MCP, shell): not served here.
BUILTIN_TOOLS = (
    "web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
    "computer", "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom",
)  # fmt: skip
# OpenAI's ``include`` values (the ``openai`` client's ``ResponseIncludable``).
INCLUDABLE = (
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs",
)  # fmt: skip
_TEXT_PARTS = ("input_text", "output_text", "text")
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")


def check_request(req: ResponsesRequest) -> None:
    check_extra_fields(req, UNSUPPORTED_RESPONSE_FIELDS)
    _check_include((req.model_extra or {}).get("include"))
    if req.top_logprobs:
        raise APIError(400, "top_logprobs: logprobs are not returned by /v1/responses (use "
                       "/v1/chat/completions); only 0", "top_logprobs", "unsupported")  # fmt: skip
    if req.truncation == "auto":
        raise APIError(400, "truncation: only 'disabled' (a prompt past the model's context "
                       "length is a 400)", "truncation", "unsupported")  # fmt: skip
    for i, tool in enumerate(req.tools or ()):
        _check_tool(tool, f"tools.{i}")


def _check_include(include: Any) -> None:
    """``include``: a list of OpenAI's includable values. Those of tools not served here and
    ``reasoning.encrypted_content`` (reasoning is returned as text) add nothing; output text
    logprobs are not returned (a 400)."""
    if include is None:
        return
    allowed = ", ".join(INCLUDABLE)
    if not isinstance(include, list):
        raise APIError(400, f"include: a list of strings, each one of {allowed}", "include")
    for i, value in enumerate(include):
        if value not in INCLUDABLE:
            raise APIError(400, f"include.{i}: {value!r} is not one of {allowed}",
                           f"include.{i}")  # fmt: skip
        if value == "message.output_text.logprobs":
            raise APIError(400, f"include.{i}: {value!r}: logprobs are not returned by "
                           "/v1/responses (use /v1/chat/completions)", f"include.{i}",
                           "unsupported")  # fmt: skip


def input_items(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A request's ``input`` as items (text is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


def chat_request(
    req: ResponsesRequest, items: list[dict[str, Any]], num_history: int = 0
) -> ChatCompletionRequest:
    """The chat request generating this response to the conversation ``items``: the
    ``num_history`` items of ``previous_response_id``'s conversation, then the request's
    ``input``."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += chat_messages(items, num_history)
    if not messages:
        raise APIError(400, "input: must not be empty", "input")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if _is_partial_answer(items[-1] if items else None):  # vLLM's partial message completion
        body |= {"continue_final_message": True, "add_generation_prompt": False}
    for name in SAMPLING_PASSTHROUGH:
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    extra = req.model_extra or {}
    if extra.get("chat_template_kwargs") is not None:  # vLLM's extension, as on the chat route
        body["chat_template_kwargs"] = extra["chat_template_kwargs"]
    effort = extra.get("reasoning")
    effort = effort.get("effort") if isinstance(effort, dict) else None
    if effort is not None:  # the chat route checks it (vLLM's values)
        body["reasoning_effort"] = effort
    if req.tools:
        body["tools"] = [chat_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    # text.format shapes a message's text; a forced call writes none (so both may be given, as
    # the Agents SDK does with an output type and a forced tool).
    forced = req.tool_choice not in (None, "none", "auto") and bool(req.tools)
    if req.text is not None and req.text.format is not None and not forced:
        response_format = req.text.format.chat_response_format()
        if response_format is not None and req.structured_outputs is not None:
            raise APIError(400, "structured_outputs: cannot be combined with text.format",
                           "structured_outputs")  # fmt: skip
        if response_format is not None:
            body["response_format"] = response_format
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _named_error(exc) from None


def _is_type_tag(part: str) -> bool:
    """A union member's tag in a pydantic error's location (``str``, ``list[str]``), not a
    field's name (``strict``)."""
    return part in ("str", "int", "float", "bool", "list", "dict") or "[" in part


def _is_partial_answer(item: Any) -> bool:
    """An assistant message left ``in_progress`` or ``incomplete`` (a response cut off by
    ``max_output_tokens``, or a prefill): the reply continues it rather than opening a turn."""
    return (
        isinstance(item, dict)
        and item.get("type", "message") == "message"
        and item.get("role") == "assistant"
        and item.get("status") in ("in_progress", "incomplete")
    )


def _named_error(exc: ValidationError) -> APIError:
    """A chat-side validation error, with the field path as the Responses request names it."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ())]
    if loc[:1] == ["tools"] and loc[2:3] == ["function"]:
        loc = loc[:2] + loc[3:]  # a Responses function tool has its fields at the top
    elif loc[:1] == ["response_format"]:
        loc = ["text", "format"] + [p for p in loc[2:] if p != "json_schema"]
    elif loc[:1] == ["reasoning_effort"]:
        loc = ["reasoning", "effort"]
    param = ".".join(p for p in loc if not _is_type_tag(p))
    return APIError(400, f"{param}: {first.get('msg')}", param, "invalid_value")


def _check_tool(tool: dict[str, Any], path: str) -> None:
    kind = tool.get("type")
    if kind == "function":
        return
    if isinstance(kind, str) and kind.startswith(BUILTIN_TOOLS):
        raise APIError(400, f"{path}.type: the built-in tool {kind!r} is not supported; only "
                       "function tools (type 'function') are", f"{path}.type",
                       "unsupported")  # fmt: skip
    raise APIError(400, f"{path}.type: must be 'function', got {kind!r}", f"{path}.type")


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """``{"type": "function", "name", "description", "parameters", "strict"}`` -> the chat
    tool (its function nested)."""
    function = {k: v for k, v in tool.items() if k != "type" and v is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice.name: required with type 'function'",
                           "tool_choice.name")  # fmt: skip
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(kind, str) and kind.startswith(BUILTIN_TOOLS):
        raise APIError(400, f"tool_choice.type: the built-in tool {kind!r} is not supported",
                       "tool_choice.type", "unsupported")  # fmt: skip
    raise APIError(400, "tool_choice: must be 'none', 'auto', 'required' or {'type': "
                   f"'function', 'name': ...}}, got type {kind!r}", "tool_choice")  # fmt: skip


def chat_messages(items: list[Any], num_history: int = 0) -> list[dict[str, Any]]:
    """Conversation items -> chat messages. A function call joins the assistant message before
    it (one assistant turn: its text and its calls); a call's output is a ``tool`` message; a
    reasoning item's text is the ``reasoning_content`` of the assistant message it precedes
    (the chat template decides whether to show it again: most drop it, harmony keeps it before
    the calls of an unfinished turn). Errors name the request's own ``input.{i}``: the first
    ``num_history`` items are the stored conversation before it."""
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items not yet given to an assistant message
    for i, item in enumerate(items):
        path = f"input.{i - num_history}" if i >= num_history else "previous_response_id"
        if not isinstance(item, dict):
            raise APIError(400, f"{path}: must be an object", path)
        kind = item.get("type", "message")
        before = len(messages)
        if kind == "reasoning":
            reasoning += _reasoning_texts(item.get("content"))
            continue
        if kind == "message":
            messages.append(_message(item, path))
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", path), "type": "function",
                    "function": {"name": _str(item, "name", path),
                                 "arguments": _str(item, "arguments", path)}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{path}.output")
            messages.append({"role": "tool", "tool_call_id": _str(item, "call_id", path),
                             "content": text})  # fmt: skip
        else:
            raise APIError(400, f"{path}.type: {kind!r} items are not supported (message, "
                           "function_call, function_call_output, reasoning)",
                           f"{path}.type", "unsupported")  # fmt: skip
        if reasoning and len(messages) > before and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "".join(reasoning)
        reasoning = []
    return messages


def _reasoning_texts(content: Any) -> list[str]:
    """The text of a reasoning item's ``reasoning_text`` parts (summaries and encrypted
    content are not the model's own words: left out)."""
    if not isinstance(content, list):
        return []
    return [
        part["text"]
        for part in content
        if isinstance(part, dict)
        and part.get("type") == "reasoning_text"
        and isinstance(part.get("text"), str)
    ]


def _message(item: dict[str, Any], path: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise APIError(400, f"{path}.role: must be one of {', '.join(_MESSAGE_ROLES)}, got "
                       f"{role!r}", f"{path}.role")  # fmt: skip
    content = item.get("content")
    if isinstance(content, list) and any(_is_image(p) for p in content):
        content = [_image_or_text(p, f"{path}.content.{j}") for j, p in enumerate(content)]
    elif not isinstance(content, str):
        content = _text(content, f"{path}.content")
    # Developer messages are the system prompt of the chat templates, which know no such role.
    return {"role": "system" if role == "developer" else role, "content": content}


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "input_image"


def _image_or_text(part: Any, path: str) -> dict[str, Any]:
    """An ``input_image`` part as a chat image part (its ``image_url``: a data: or http(s)
    URL; ``file_id`` refers to a file store this server has not), or a text part."""
    if _is_image(part):
        url = part.get("image_url")
        if not isinstance(url, str):
            raise APIError(400, f"{path}.image_url: must be a data: or http(s) URL (file_id is "
                                "not supported)", f"{path}.image_url")  # fmt: skip
        return image_part(url)
    return {"type": "text", "text": _part_text(part, path)}


def _text(parts: Any, path: str) -> str:
    """Text content parts joined by newlines, as the chat route joins text parts; other parts
    (images, files, audio) are a 400."""
    if not isinstance(parts, list):
        raise APIError(400, f"{path}: must be a string or a list of text parts", path)
    texts = [_part_text(part, f"{path}.{j}") for j, part in enumerate(parts)]
    return "\n".join(t for t, part in zip(texts, parts, strict=True) if part["type"] != "refusal")


def _part_text(part: Any, path: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "refusal":
        return ""  # an assistant's refusal, sent back: no text for the model
    if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
        raise APIError(400, f"{path}: only text and input_image parts are supported "
                       f"(input_text, output_text, input_image), got {kind!r}", path,
                       "unsupported")  # fmt: skip
    return part["text"]


def _str(item: dict[str, Any], name: str, path: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{path}.{name}: must be a string", f"{path}.{name}")
    return value


__all__ = ["BUILTIN_TOOLS", "chat_messages", "chat_request", "check_request", "input_items"]
