"""OpenAI request -> the ``GenerateRequest`` (or ``EmbedRequest``) a model replica serves:
OpenAI's fields mapped to the engine's ``SamplingParams`` names, chat messages flattened for
the chat template. Fields the engine does not support are a 400 naming them."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from cluster.api.api_errors import APIError
from cluster.api.forced_tool_calls import find_tool, named_tool_schema, required_tools_schema
from cluster.api.openai_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    TokenizeRequest,
)
from cluster.api.replica_messages import EmbedRequest, GenerateRequest

logger = logging.getLogger("llm_cluster.api")


@dataclass(frozen=True)
class Unsupported:
    """A request field this server does not serve: a 400 naming it and saying ``why``, unless
    null (not given, as in vLLM) or one of ``off``, the values that change nothing, compared
    with their type (``0`` is not ``false``)."""

    why: str
    off: tuple[Any, ...] = ()

    def allows(self, value: Any) -> bool:
        return value is None or any(type(value) is type(v) and value == v for v in self.off)


_MM_KWARGS = "per-request multimodal processing settings are not supported"
# Fields outside the declared ones that would change the output and are not supported. Any
# other undeclared field is ignored (logged once at debug), as vLLM does: clients fill in
# ``metadata``, ``store``, ``service_tier`` and the like.
UNSUPPORTED_FIELDS = {
    "functions": Unsupported("the legacy functions API is not supported; use tools"),
    "function_call": Unsupported("the legacy functions API is not supported; use tool_choice"),
    "audio": Unsupported("audio output is not supported"),
    "modalities": Unsupported("only text output is supported", (["text"],)),
    "web_search_options": Unsupported("web search is not supported"),
    "logits_processors": Unsupported("custom logits processors are not supported"),
    "guided_decoding_backend": Unsupported(
        "the grammar backend is xgrammar; only 'xgrammar' or 'auto' is accepted",
        ("xgrammar", "auto"),
    ),
    "structural_tag": Unsupported("not supported"),
    # vLLM's extensions this server does not serve.
    "use_beam_search": Unsupported(
        "beam search is not served over HTTP (offline: LLM.beam_search)", (False,)
    ),
    "length_penalty": Unsupported("only with beam search, which is not served", (1.0, 1)),
    "return_tokens_as_token_ids": Unsupported("not supported", (False,)),
    "return_token_ids": Unsupported("not supported", (False,)),
    "logprob_token_ids": Unsupported("not supported; use logprobs / top_logprobs", ([],)),
    "prompt_embeds": Unsupported("prompt embeddings are not supported; send text or token ids"),
    "repetition_detection": Unsupported("not supported"),
    "thinking_token_budget": Unsupported("not supported", (-1,)),
    "watermarking": Unsupported("not supported", (False,)),
    "vllm_xargs": Unsupported("not supported", ({},)),
    # vLLM refuses these unless started with --trust-request-mm-kwargs.
    "mm_processor_kwargs": Unsupported(_MM_KWARGS, ({},)),
    "media_io_kwargs": Unsupported(_MM_KWARGS, ({},)),
    # vLLM's for an external prefill/decode proxy; here the deployment's prefill_config pairs
    # the pools, and the ingress sets them itself.
    "kv_transfer_params": Unsupported(
        "set by the server for its prefill and decode pools (a model's prefill_config), not "
        "by a request",
        ({},),
    ),
}
_ignored_logged: set[str] = set()


def check_extra_fields(
    req: BaseModel, unsupported: Mapping[str, Unsupported] = UNSUPPORTED_FIELDS
) -> None:
    """The one check of a request's undeclared fields (every route): a 400 for one in
    ``unsupported`` that its rule does not allow; any other is ignored."""
    for name, value in (req.model_extra or {}).items():
        rule = unsupported.get(name)
        if rule is not None and not rule.allows(value):
            raise APIError(400, f"{name}: {rule.why}", name, "unsupported")
        if rule is None and name not in _ignored_logged:
            _ignored_logged.add(name)
            logger.debug("ignoring request field %r (it does not change the output)", name)


# Fields passed to the engine under the same name when they differ from its default (the engine
# checks their ranges and caps, and its 400s name them).
_SAME_NAME_FIELDS = (
    "n", "seed", "min_tokens", "stop_token_ids", "include_stop_str_in_output", "logit_bias",
    "bad_words", "allowed_token_ids", "spaces_between_special_tokens",
)  # fmt: skip
# Fields passed only when the request gives them (not null): the replica fills in the rest from
# the model's generation_config, then the engine's defaults (vLLM's order;
# ``engine.generation_defaults``).
_MODEL_DEFAULT_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty",
)  # fmt: skip


def sampling_params(req: SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    check_extra_fields(req)
    sent = req.stream_options is not None and req.stream_options.model_fields_set
    if sent and not req.stream:  # ``{}`` sets no option (vLLM's rule)
        raise APIError(400, "stream_options: only allowed with stream: true", "stream_options")
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
    }
    for name in _MODEL_DEFAULT_FIELDS:
        if name in req.model_fields_set:  # (null is not given: ``OrNull``)
            params[name] = getattr(req, name)
    defaults = SamplingFields.model_fields
    for name in _SAME_NAME_FIELDS:
        value = getattr(req, name)
        if value != defaults[name].default:
            params[name] = value
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    grammar = structured_outputs(req)
    if grammar is not None:
        params["structured_outputs"] = grammar
    if req.prompt_logprobs is not None:
        # As in vLLM: a stream has no field for them (0 is accepted and returns nothing).
        if req.stream and req.prompt_logprobs > 0:
            raise APIError(400, "prompt_logprobs: not available with stream: true",
                           "prompt_logprobs")  # fmt: skip
        if not req.stream:
            params["prompt_logprobs"] = req.prompt_logprobs
    return params


def structured_outputs(req: SamplingFields) -> dict[str, Any] | None:
    """The engine's ``StructuredOutputsParams`` fields from whichever of ``response_format``,
    ``structured_outputs`` or ``guided_*`` the request uses (at most one of them)."""
    given = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "response_format.json_schema.schema: required with type "
                           "json_schema", "response_format.json_schema.schema")  # fmt: skip
        given["response_format"] = {"json": json.dumps(fmt.json_schema.json_schema)}
    if req.structured_outputs is not None:
        spec = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        spec = {k: v for k, v in spec.items() if v is not False}
        if isinstance(spec.get("json"), dict):
            spec["json"] = json.dumps(spec["json"])
        given["structured_outputs"] = spec
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice,
              "grammar": req.guided_grammar}  # fmt: skip
    for kind, value in guided.items():
        if value is not None:
            text = json.dumps(value) if isinstance(value, dict) else value
            given[f"guided_{kind}"] = {kind: text}
    if len(given) > 1:
        names = " and ".join(sorted(given))
        raise APIError(400, f"{names}: give at most one way to constrain the output",
                       sorted(given)[0])  # fmt: skip
    return next(iter(given.values()), None)


def grammar_param(param: str | None, req: SamplingFields) -> str | None:
    """An engine error's ``structured_outputs.<kind>`` param as this request named the grammar:
    ``response_format.json_schema.schema`` or ``guided_<kind>``; any other param as it is."""
    kind = (param or "").removeprefix("structured_outputs.")
    if param is None or kind == param or req.structured_outputs is not None:
        return param
    fmt = req.response_format
    if kind == "json" and fmt is not None and fmt.type == "json_schema":
        return "response_format.json_schema.schema"
    if getattr(req, f"guided_{kind}", None) is not None:
        return f"guided_{kind}"
    return param


MAX_PROMPTS_PER_REQUEST = 256
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on an embeddings request's inputs


def completion_payloads(req: CompletionRequest) -> list[GenerateRequest]:
    """One payload per prompt of the request (a string, token ids, or a batch of either):
    choice ``i * n + j`` of the response is sample j of prompt i, as in OpenAI's API."""
    # best_of = n samples n and returns them all; ranking more samples than returned is not done.
    if req.best_of is not None and req.best_of not in (1, req.n):
        raise APIError(400, f"best_of: only best_of = n ({req.n}) is supported", "best_of",
                       "unsupported")  # fmt: skip
    if req.suffix:
        raise APIError(400, "suffix: not supported (no fill-in-the-middle)", "suffix",
                       "unsupported")  # fmt: skip
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens: must be >= 1 (0 only with echo: true)", "max_tokens")
    # Echo without generation still runs one decode step (the engine samples at least one
    # token); the response leaves that token out.
    params = sampling_params(req, 1 if req.max_tokens == 0 else req.max_tokens)
    if req.logprobs is not None:
        params["logprobs"] = req.logprobs
        if req.echo:  # the echoed prompt's logprobs (vLLM's, unless prompt_logprobs is given)
            params.setdefault("prompt_logprobs", req.logprobs)
    prompts = _prompts(req.prompt)
    extras = request_extras(req)
    if not req.add_special_tokens:
        extras["add_special_tokens"] = False
    return [
        GenerateRequest(params=params, prompt_token_ids=p, echo=req.echo, **extras)
        if isinstance(p, list)
        else GenerateRequest(params=params, prompt=p, echo=req.echo, **extras)
        for p in prompts
    ]


def embedding_payloads(value: Any) -> list[EmbedRequest]:
    """One server request per input of an embeddings request: a string, token ids, or a batch
    of either."""
    if isinstance(value, str):
        return [EmbedRequest(prompt=value)]
    if not value:
        raise APIError(400, "input: must not be empty", "input")
    if isinstance(value[0], int):
        return [EmbedRequest(prompt_token_ids=value)]
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise APIError(400, f"input: at most {MAX_EMBEDDING_INPUTS} inputs per request, "
                       f"got {len(value)}", "input")  # fmt: skip
    return [
        EmbedRequest(prompt=v) if isinstance(v, str) else EmbedRequest(prompt_token_ids=v)
        for v in value
    ]


def _prompts(prompt: Any) -> list[Any]:
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))):
        return [prompt]
    if len(prompt) > MAX_PROMPTS_PER_REQUEST:
        raise APIError(400, f"prompt: at most {MAX_PROMPTS_PER_REQUEST} prompts per request, "
                       f"got {len(prompt)}", "prompt")  # fmt: skip
    return list(prompt)


@dataclass(frozen=True)
class ToolChoice:
    """How a chat response reads tool calls: ``auto`` parses the model's text with its
    ``tool_call_parser``; ``required`` and ``named`` read output constrained by the tools'
    JSON schema (an array of calls, or the named function's arguments)."""

    mode: Literal["auto", "required", "named"]
    name: str | None = None
    parallel: bool = True
    # The JSON schema the tools declare for each (function, parameter): a parser whose format
    # writes values as bare text types them by it (``qwen3_coder``; ``glm45`` only asks which
    # are strings).
    parameter_schemas: Mapping[tuple[str, str], dict[str, Any]] = field(default_factory=dict)


def chat_payload(req: ChatCompletionRequest) -> GenerateRequest:
    options = template_options(req)
    max_tokens = req.max_completion_tokens
    max_tokens = max_tokens if max_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens)
    if req.top_logprobs and not req.logprobs:  # 0 is the default; vLLM's clients send it
        raise APIError(400, "top_logprobs: requires logprobs: true", "top_logprobs")
    if req.logprobs:
        params["logprobs"] = req.top_logprobs or 0
    choice = tool_choice(req)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    if choice is not None and choice.mode != "auto":
        _check_no_grammar_beside(req, choice)
        schema = (
            required_tools_schema(tools or [], choice.parallel)
            if choice.mode == "required"
            else named_tool_schema(find_tool(tools or [], choice.name or ""))
        )
        params["structured_outputs"] = {"json": json.dumps(schema)}
    template_kwargs = dict(options.pop("chat_template_kwargs", None) or {})
    if req.documents is not None:
        template_kwargs["documents"] = req.documents
    if req.reasoning_effort is not None:  # as vLLM: the effort, and thinking unless "none"
        template_kwargs["reasoning_effort"] = req.reasoning_effort
        template_kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
    return GenerateRequest(
        params=params,
        messages=chat_messages(req.messages),
        tools=tools,
        chat_template_kwargs=template_kwargs or None,
        tool_choice=choice.mode if choice is not None else None,
        **options,
        **request_extras(req),
    )


# The request fields that name a grammar outright (``response_format`` describes the text of a
# message instead).
_GRAMMAR_FIELDS = (
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
)  # fmt: skip


def _check_no_grammar_beside(req: ChatCompletionRequest, choice: ToolChoice) -> None:
    """A forced call's grammar is the tools' schema, and it replaces the request's own:
    ``response_format`` shapes a message's text, which a forced call does not write, so it is
    dropped (as vLLM and OpenAI do, and as the Responses route drops ``text.format``); an
    explicit grammar (``structured_outputs``, ``guided_*``) is a 400, as in vLLM."""
    for name in _GRAMMAR_FIELDS:
        if getattr(req, name) is not None:
            raise APIError(400, f"{name}: cannot be combined with a forced tool call "
                           f"(tool_choice {choice.mode!r})", name)  # fmt: skip


def template_options(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """The ``GenerateRequest`` fields of a chat request's template options (vLLM's
    ``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``,
    ``chat_template_kwargs``), those that differ from the defaults. A request-supplied
    template is a 400. ``chat_template_kwargs`` are variables for the model's template (those
    it does not read are dropped where it renders); the request's own fields win over them."""
    if req.chat_template is not None:
        raise APIError(400, "chat_template: request-supplied chat templates are not accepted; "
                       "the model's own is used", "chat_template", "unsupported")  # fmt: skip
    kwargs = req.chat_template_kwargs or {}
    refused = sorted(_NOT_TEMPLATE_VARIABLES & kwargs.keys())
    if refused:
        raise APIError(400, f"chat_template_kwargs: {refused[0]!r} is not a template variable",
                       "chat_template_kwargs")  # fmt: skip
    # continue_final_message leaves the last message open, whoever's it is (as vLLM does).
    asked = "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt
    if req.continue_final_message and asked:
        raise APIError(400, "add_generation_prompt: cannot be true with "
                       "continue_final_message", "add_generation_prompt")  # fmt: skip
    options: dict[str, Any] = {}
    if not req.add_generation_prompt or req.continue_final_message:
        options["add_generation_prompt"] = False
    if req.continue_final_message:
        options["continue_final_message"] = True
    if req.add_special_tokens:
        options["add_special_tokens"] = True
    variables = {k: v for k, v in kwargs.items() if k not in _REQUEST_FIELDS}
    if variables:
        options["chat_template_kwargs"] = variables
    return options


# chat_template_kwargs keys vLLM refuses, and those the request's own fields set.
_NOT_TEMPLATE_VARIABLES = frozenset({"chat_template", "tokenize"})
_REQUEST_FIELDS = frozenset({"add_generation_prompt", "continue_final_message"})


def tokenize_payload(req: TokenizeRequest) -> GenerateRequest:
    """The server's request for ``/tokenize``: its prompt, or its messages with the chat
    route's template options."""
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "prompt: give exactly one of prompt or messages", "prompt")
    if req.messages is None:
        special = {"add_special_tokens": False} if req.add_special_tokens is False else {}
        return GenerateRequest(prompt=req.prompt, **special)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return GenerateRequest(messages=chat_messages(req.messages), tools=tools,
                           **template_options(req))  # fmt: skip


def chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the text the answer starts with, the last message's when it has
    the answer's role (the assistant's; with ``add_generation_prompt`` false, the last
    message's own), its text parts joined by newlines; else ""."""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    if not req.echo or last.role != role:
        return ""
    content = chat_messages([last])[0]["content"]  # its text as the template gets it
    if isinstance(content, list):  # with images: its text parts
        return "\n".join(part["text"] for part in content if part["type"] == "text")
    return content or ""


def stream_usage(req: SamplingFields) -> tuple[bool, bool]:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``) and whether
    every chunk carries the usage so far (vLLM's ``continuous_usage_stats``, only with
    ``include_usage``)."""
    options = req.stream_options
    if options is None or not options.include_usage:
        return False, False
    return True, bool(options.continuous_usage_stats)


def tool_choice(req: ChatCompletionRequest) -> ToolChoice | None:
    """The request's tool choice (OpenAI's default: ``auto`` when tools are given), or None
    when no tool call can come back (no tools, or ``tool_choice: "none"``)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice: requires tools", "tool_choice")
        return None
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        schemas = dict(_parameter_schemas(req.tools))
        return ToolChoice("auto", parallel=req.parallel_tool_calls, parameter_schemas=schemas)
    if choice == "required":
        return ToolChoice("required", parallel=req.parallel_tool_calls)
    name = choice.function.name
    if name not in {t.function.name for t in req.tools}:
        names = ", ".join(t.function.name for t in req.tools)
        raise APIError(400, f"tool_choice.function.name: no tool named {name!r} (tools: "
                       f"{names})", "tool_choice.function.name")  # fmt: skip
    return ToolChoice("named", name=name)


def _parameter_schemas(tools: list[Any]) -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
    """((function, parameter), schema) of each parameter the tools' JSON schemas declare."""
    for tool in tools:
        properties = (tool.function.parameters or {}).get("properties")
        if isinstance(properties, dict):
            for key, schema in properties.items():
                if isinstance(schema, dict):
                    yield (tool.function.name, key), schema


def request_extras(req: SamplingFields) -> dict[str, Any]:
    """Per-request settings beside the sampling parameters (the server checks them)."""
    extras = {"cache_salt": req.cache_salt, "timeout": req.timeout,
              "truncate_prompt_tokens": req.truncate_prompt_tokens,
              "truncation_side": req.truncation_side, "priority": req.priority or None}  # fmt: skip
    return {k: v for k, v in extras.items() if v is not None}


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template: text content parts (``[{"type": "text", "text": ...}]``)
    joined into one string, one part a line (vLLM's); a message with ``image_url`` parts keeps
    its parts (text and ``{"type": "image_url", "image_url": {"url": ...}}``, the URL checked
    and fetched by the ingress: ``cluster.api.media``); other parts are a 400."""
    out = []
    for i, message in enumerate(messages):
        # Undeclared fields clients send back (an assistant's ``refusal``) are left out.
        entry = message.model_dump(exclude_none=True, exclude=set(message.model_extra or ()))
        entry.setdefault("content", None)
        if isinstance(message.content, list):
            parts = [_content_part(p, f"messages.{i}.content.{j}")
                     for j, p in enumerate(message.content)]  # fmt: skip
            parts = [p for p in parts if p is not None]
            if any(p["type"] == "image_url" for p in parts):
                entry["content"] = parts
            else:  # as vLLM joins them for a template that takes text content
                entry["content"] = "\n".join(p["text"] for p in parts)
        out.append(entry)
    return out


# Text-like part types and the key of their text (vLLM's ``TEXT_PART_TYPES``).
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
               "refusal": "refusal", "thinking": "thinking"}  # fmt: skip


def _content_part(part: Any, param: str) -> dict[str, Any] | None:
    """A content part as the template gets it (None: a text part whose text is null, which
    vLLM skips)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS and isinstance(part.get(_TEXT_PARTS[kind]), str):
        return {"type": "text", "text": part[_TEXT_PARTS[kind]]}
    if kind in _TEXT_PARTS and part.get(_TEXT_PARTS[kind]) is None:
        return None
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else None
        if not isinstance(url, str):
            raise APIError(400, f"{param}.image_url.url: must be a string (a data: or http(s) "
                                "URL)", f"{param}.image_url.url")  # fmt: skip
        return image_part(url)
    raise APIError(400, f"{param}: only text ({', '.join(_TEXT_PARTS)}) and image_url parts "
                   f"are supported, got {kind!r}", param)  # fmt: skip


def image_part(url: str) -> dict[str, Any]:
    """A chat image content part (the shape the Responses and Messages APIs map theirs to)."""
    return {"type": "image_url", "image_url": {"url": url}}
