"""A Messages API request -> the chat request the chat route serves (``ChatCompletionRequest``):
``system`` and ``messages`` become chat messages, ``tools`` and ``tool_choice`` the chat
function tools and choice, ``stop_sequences`` the chat ``stop``. The chat path then does the
rest (template, tool parsers, reasoning parser, structured outputs for forced calls).

    user:      text blocks            -> a user message (texts joined)
               tool_result blocks     -> tool messages (tool_call_id = tool_use_id), first;
                                         a result's images a user message after it
    assistant: text / tool_use blocks -> one assistant message with its tool_calls
               thinking blocks        -> its reasoning_content
    tool_choice: auto -> auto, any -> required, tool -> the named function, none -> none

Text blocks are joined as vLLM joins them, so prompts render alike: a turn's (and a
tool_result's) one a line, as the chat route joins text parts; ``system`` blocks with nothing
between them. A final assistant message is a prefill: the chat's ``continue_final_message``.
``output_config.format`` is the chat ``response_format`` (json_schema). ``thinking`` is no chat
field: it is the chat template's ``enable_thinking`` (``template_kwargs``), which reasoning
models' templates read."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from cluster.api.anthropic_models import (
    MAX_TEMPERATURE,
    MIN_THINKING_BUDGET,
    SAMPLING_PASSTHROUGH,
    CountTokensRequest,
    MessagesRequest,
    OutputFormat,
)
from cluster.api.api_errors import APIError, field_path
from cluster.api.openai_models import ChatCompletionRequest
from cluster.api.openai_payloads import (
    UNSUPPORTED_FIELDS,
    Unsupported,
    check_extra_fields,
    image_part,
)

# Block types the model cannot read (yet): a 400 naming the block.
_UNSUPPORTED_BLOCKS = {
    "document": "document blocks are not supported yet (text and images only)",
    "search_result": "search_result blocks are not supported (text only)",
}
_NO_TEMPLATE = "request-supplied chat templates are not accepted; the model's own template is used"
_USE_FORMAT = "not a Messages API field; use output_config.format"
# Undeclared fields that would change the output and are not served (``check_extra_fields``):
# vLLM's Messages extensions and the chat route's fields a client may send here by mistake.
# Others (``container``, ``mcp_servers``, ``context_management``, ...) are ignored, as vLLM does.
UNSUPPORTED_MESSAGES_FIELDS = {
    "chat_template": Unsupported(_NO_TEMPLATE),
    "vllm_xargs": Unsupported("not supported", ({},)),
    "watermarking": Unsupported("watermarking is not supported", (False,)),
    "response_format": Unsupported(_USE_FORMAT),
    "structured_outputs": Unsupported(_USE_FORMAT),
    "guided_json": Unsupported(_USE_FORMAT),
    "guided_regex": Unsupported(_USE_FORMAT),
    "guided_choice": Unsupported(_USE_FORMAT),
    "guided_grammar": Unsupported(_USE_FORMAT),
    "reasoning_effort": Unsupported("not a Messages API field; use output_config.effort"),
    "n": Unsupported("one message per request", (1,)),
    "truncate_prompt_tokens": Unsupported("prompt truncation is not supported"),
    "allowed_token_ids": Unsupported("not supported"),
    **{name: UNSUPPORTED_FIELDS[name] for name in ("logits_processors", "structural_tag")},
}  # fmt: skip


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request generating the reply to ``req`` (a count_tokens request: its prompt)."""
    check_extra_fields(req, UNSUPPORTED_MESSAGES_FIELDS)
    system = system_text(req.system)
    messages = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(req.messages):
        messages += chat_messages(message.role, message.content, f"messages.{i}")
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.messages[-1].role == "assistant":  # a prefill: the reply continues it
        _check_prefill(messages[-1], f"messages.{len(req.messages) - 1}")
        body["continue_final_message"] = True
    if isinstance(req, MessagesRequest):
        body.update(_generation_fields(req))
    kwargs = (req.model_extra or {}).get("chat_template_kwargs")
    if kwargs is not None:  # vLLM's extension, as on the chat route (over thinking's)
        body["chat_template_kwargs"] = kwargs
    if req.output_config is not None and req.output_config.effort is not None:
        body["reasoning_effort"] = req.output_config.effort  # a template variable
    check_thinking(req)
    if req.tools:
        body["tools"] = [chat_tool(t.model_dump(), f"tools.{i}") for i, t in enumerate(req.tools)]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = chat_tool_choice(choice.type, choice.name, bool(req.tools))
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _named_error(exc) from None


def _generation_fields(req: MessagesRequest) -> dict[str, Any]:
    """The chat fields of a Messages request's sampling and output settings."""
    if req.temperature is not None and not 0 <= req.temperature <= MAX_TEMPERATURE:
        raise APIError(400, f"temperature: must be in [0, {MAX_TEMPERATURE}], got "
                       f"{req.temperature}", "temperature")  # fmt: skip
    body: dict[str, Any] = {"stream": req.stream}
    for name in SAMPLING_PASSTHROUGH:
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    fmt = _output_format(req)
    if fmt is not None:
        schema = {"name": "output", "schema": fmt.json_schema}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return body


def _output_format(req: MessagesRequest) -> OutputFormat | None:
    """``output_config.format``, or the beta ``output_format`` (one of them): the grammar of
    the reply's text, as the chat route's ``response_format``, which a forced tool call's
    grammar replaces (the turn writes a call, no text)."""
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None and req.output_format is not None:
        raise APIError(400, "output_format: give output_config.format or output_format, not "
                       "both", "output_format")  # fmt: skip
    return fmt or req.output_format


def template_kwargs(req: CountTokensRequest) -> dict[str, Any] | None:
    """The chat template's variables for ``thinking`` (None: the model's default)."""
    if req.thinking is None:
        return None
    return {"enable_thinking": req.thinking.type != "disabled"}


def check_thinking(req: CountTokensRequest) -> None:
    thinking = req.thinking
    if thinking is None or thinking.type != "enabled":
        return
    if thinking.budget_tokens is None:
        raise APIError(400, "thinking.budget_tokens: required with type 'enabled'",
                       "thinking.budget_tokens")  # fmt: skip
    if thinking.budget_tokens < MIN_THINKING_BUDGET:
        raise APIError(400, f"thinking.budget_tokens: must be >= {MIN_THINKING_BUDGET}, got "
                       f"{thinking.budget_tokens}", "thinking.budget_tokens")  # fmt: skip
    # Anthropic's rule (and vLLM's): the thinking fits inside the reply.
    if isinstance(req, MessagesRequest) and thinking.budget_tokens >= req.max_tokens:
        raise APIError(400, f"thinking.budget_tokens: must be less than max_tokens "
                       f"({req.max_tokens}), got {thinking.budget_tokens}",
                       "thinking.budget_tokens")  # fmt: skip


# Claude Code's first system block: a per-request attribution hash, which changes the prompt's
# first tokens on every request (no prefix cache hit) and says nothing to the model.
_BILLING_HEADER = "x-anthropic-billing-header"


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    """``system`` as one text: a list of text blocks is joined with nothing between them, as
    vLLM joins them (so prompts render alike), less a block holding Claude Code's billing
    header (as vLLM drops it)."""
    if system is None or isinstance(system, str):
        return system or ""
    texts = (_block_text(block, f"system.{j}") for j, block in enumerate(system))
    return "".join(text for text in texts if not text.startswith(_BILLING_HEADER))


def _joined(texts: list[str]) -> str:
    """A turn's text blocks as one text: one a line, as the chat route (and vLLM) joins text
    parts."""
    return "\n".join(texts)


def chat_messages(
    role: str, content: str | list[dict[str, Any]], path: str
) -> list[dict[str, Any]]:
    """One Messages API message -> its chat messages (a user turn's tool results are tool
    messages before its text; an assistant turn is one message with its calls)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "assistant":
        return [_assistant_message(content, f"{path}.content")]
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        block_path = f"{path}.content.{j}"
        kind = _block_type(block, block_path)
        if kind == "tool_result":
            tool_messages += _tool_messages(block, block_path)
        elif kind == "image":
            parts.append(image_part(_image_url(block, block_path)))
        else:
            parts.append({"type": "text", "text": _block_text(block, block_path)})
    if not parts:
        return tool_messages
    if all(p["type"] == "text" for p in parts):
        return [*tool_messages, {"role": "user", "content": _joined([p["text"] for p in parts])}]
    return [*tool_messages, {"role": "user", "content": parts}]


def _image_url(block: dict[str, Any], path: str) -> str:
    """An image block's source as a URL: ``base64`` (``media_type``, ``data``) as a data URL,
    ``url`` as it is (fetched by the ingress where allowed: ``cluster.api.media``)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type = _str(source, "media_type", f"{path}.source")
        return f"data:{media_type};base64,{_str(source, 'data', f'{path}.source')}"
    if kind == "url":
        return _str(source, "url", f"{path}.source")
    raise APIError(400, f"{path}.source.type: must be 'base64' or 'url', got {kind!r}",
                   f"{path}.source.type")  # fmt: skip


def _assistant_message(blocks: list[dict[str, Any]], path: str) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        block_path = f"{path}.{j}"
        kind = _block_type(block, block_path)
        if kind == "tool_use":
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append({"id": _str(block, "id", block_path), "type": "function",
                          "function": {"name": _str(block, "name", block_path),
                                       "arguments": arguments}})  # fmt: skip
        elif kind == "thinking":
            reasoning.append(_str(block, "thinking", block_path))
        elif kind != "redacted_thinking":  # encrypted by another server: nothing to show
            texts.append(_block_text(block, block_path))
    message: dict[str, Any] = {"role": "assistant", "content": _joined(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return message


def _check_prefill(message: dict[str, Any], path: str) -> None:
    if message.get("tool_calls") or not message.get("content"):
        raise APIError(400, f"{path}: a final assistant message (a prefill the reply continues) "
                       "must be non-empty text, with no tool_use", path)  # fmt: skip


def _tool_messages(block: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """A ``tool_result`` block: its content (a string, or text and image blocks) as a tool
    message of its texts, then its images, if any, as a user message of image parts (the chat
    has no images in tool messages; vLLM's conversion). The chat has no error flag, so an
    ``is_error`` result says so in its text."""
    content = block.get("content", "")
    images: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for k, item in enumerate(content):
            item_path = f"{path}.content.{k}"
            if _block_type(item, item_path) == "image":
                images.append(image_part(_image_url(item, item_path)))
            else:
                texts.append(_block_text(item, item_path))
        text = _joined(texts)
    else:
        raise APIError(400, f"{path}.content: must be a string or a list of text and image "
                       "blocks", f"{path}.content")  # fmt: skip
    if block.get("is_error") is True:
        text = f"Error: {text}"
    tool_message = {"role": "tool", "tool_call_id": _str(block, "tool_use_id", path),
                    "content": text}  # fmt: skip
    return [tool_message, {"role": "user", "content": images}] if images else [tool_message]


def _block_type(block: Any, path: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise APIError(400, f"{path}: must be a content block with a type", path)
    kind = block["type"]
    if kind in _UNSUPPORTED_BLOCKS:
        raise APIError(400, f"{path}: {_UNSUPPORTED_BLOCKS[kind]}", path, "unsupported")
    return kind


def _block_text(block: Any, path: str) -> str:
    kind = _block_type(block, path)
    if kind != "text":
        raise APIError(400, f"{path}.type: expected a text block here, got {kind!r}",
                       f"{path}.type")  # fmt: skip
    text = _str(block, "text", path)
    if not text:
        raise APIError(400, f"{path}.text: text content blocks must be non-empty",
                       f"{path}.text")  # fmt: skip
    return text


def _str(block: dict[str, Any], name: str, path: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{path}.{name}: must be a string", f"{path}.{name}")
    return value


def chat_tool(tool: dict[str, Any], path: str) -> dict[str, Any]:
    """A client tool -> the chat function tool; server tools (``web_search_…``,
    ``bash_…``, ...) are not run here."""
    if tool.get("type") not in (None, "custom"):
        raise APIError(400, f"{path}.type: the server tool {tool['type']!r} is not supported; "
                       "only client tools (name, description, input_schema) are",
                       f"{path}.type", "unsupported")  # fmt: skip
    schema = tool.get("input_schema")
    if schema is None:
        raise APIError(400, f"{path}.input_schema: required (a JSON schema of the tool's input)",
                       f"{path}.input_schema")  # fmt: skip
    # As vLLM: a schema that leaves out its type is an object's, ``type`` last (the template
    # shows the schema as written).
    if "type" not in schema:
        schema = {**schema, "type": "object"}
    function = {"name": tool["name"], "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def chat_tool_choice(kind: str, name: str | None, has_tools: bool) -> str | dict[str, Any]:
    if kind == "tool":
        if name is None:
            raise APIError(400, "tool_choice.name: required with type 'tool'", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    if kind != "none" and not has_tools:
        raise APIError(400, f"tool_choice: type {kind!r} requires tools", "tool_choice")
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def _named_error(exc: ValidationError) -> APIError:
    """A chat-side validation error, with the field path as the Messages request names it."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ())]
    if loc[:1] == ["tools"] and loc[2:3] == ["function"]:
        loc = loc[:2] + ["input_schema" if p == "parameters" else p for p in loc[3:]]
    elif loc[:1] == ["stop"]:
        loc = ["stop_sequences", *loc[2:]]
    param = ".".join(field_path(loc))
    return APIError(400, f"{param}: {first.get('msg')}", param, "invalid_value")


__all__ = [
    "UNSUPPORTED_MESSAGES_FIELDS",
    "chat_request",
    "check_thinking",
    "system_text",
    "template_kwargs",
]
