"""A request's inputs for the engine, on the model replica's front (``LLMServer``): its sampling
dict as ``SamplingParams``, and chat messages as prompt ids by the model's chat template (a
harmony model's by the harmony template, ``engine.harmony_template``); for a
vision-language model, a chat's image parts (data URLs) decoded and preprocessed here, on the
front, so the head receives pixels and expanded prompt ids (``chat_prompt``). Errors are
``InvalidRequestError``s naming the field, which the front returns as 400s."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any

import msgspec
from jinja2 import TemplateError, meta, nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cluster.api.replica_messages import EmbedRequest, GenerateRequest
from engine.chat_messages import rendered
from engine.errors import InvalidRequestError
from engine.harmony_template import HARMONY_CHAT_TEMPLATE, harmony_prompt_ids, is_harmony_tokenizer
from engine.multimodal.chat import split_content_parts
from engine.multimodal.processor import MultiModalProcessor
from engine.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("llm_cluster.serve")

_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


def sampling_params_from(params: dict[str, Any]) -> SamplingParams:
    """``SamplingParams`` from a request's sampling dict; a key that is not one of its fields
    (or of ``structured_outputs``') is a 400 naming it."""
    unknown = sorted(set(params) - _SAMPLING_FIELDS)
    if unknown:
        raise InvalidRequestError("is not a sampling parameter", param=unknown[0])
    spec = params.get("structured_outputs")
    if isinstance(spec, dict):
        names = set(StructuredOutputsParams.__struct_fields__)
        bad = sorted(set(spec) - names)
        if bad:
            raise InvalidRequestError("is not a structured output field",
                                      param=f"structured_outputs.{bad[0]}")  # fmt: skip
        params = {**params, "structured_outputs": StructuredOutputsParams(**spec)}
    return SamplingParams(**params)


@dataclass(frozen=True)
class TemplateOptions:
    """How chat messages are rendered (vLLM's request fields of the same names):
    ``add_generation_prompt`` puts the template's opening of the assistant's turn after them;
    ``continue_final_message`` leaves the last message open for the output to continue instead
    (a prefill); ``add_special_tokens`` adds the tokenizer's special tokens (BOS) on top of
    those the template writes; ``template_kwargs`` are variables for the template."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    template_kwargs: dict[str, Any] | None = None


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    options: TemplateOptions = TemplateOptions(),
) -> list[int]:
    """The prompt ids of chat ``messages`` by the model's chat template (a 400 on ``messages``
    when the template rejects them). As vLLM does, ``developer`` messages are ``system`` ones
    for a template that does not know the role, and an assistant's earlier tool calls carry
    their arguments as objects (``engine.chat_messages``). A harmony model's (gpt-oss's) chats are
    rendered by the harmony template, not the checkpoint's, with the request's text as ordinary
    text (``engine.harmony_template``), as vLLM renders them with openai_harmony."""
    harmony = is_harmony_tokenizer(tokenizer)
    template = HARMONY_CHAT_TEMPLATE if harmony else getattr(tokenizer, "chat_template", None)
    if template is None:
        raise InvalidRequestError("this model has no chat template", param="messages")
    if not _knows_developer_role(template):
        messages = developer_as_system(messages)
    if options.template_kwargs:
        kwargs = _template_kwargs(template, options.template_kwargs, harmony)
        options = dataclasses.replace(options, template_kwargs=kwargs)
    render = _harmony_ids if harmony else _template_ids
    try:
        return render(tokenizer, messages, tools, options)
    except TemplateError as exc:  # the template's raise_exception: roles, order
        raise InvalidRequestError(f"the chat template rejected them: {exc}", "messages") from exc
    except Exception as exc:  # anything else may quote internals: the log has it
        logger.exception("chat template failed")
        raise InvalidRequestError("the chat template rejected them", "messages") from exc


def _template_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    options: TemplateOptions,
) -> list[int]:
    text_or_ids = rendered(
        lambda shaped: tokenizer.apply_chat_template(
            shaped,
            tools=tools,
            add_generation_prompt=options.add_generation_prompt
            and not options.continue_final_message,
            continue_final_message=options.continue_final_message,
            tokenize=not options.add_special_tokens,
            return_dict=False,
            **(options.template_kwargs or {}),
        ),
        messages,
    )
    if options.add_special_tokens:
        return list(tokenizer.encode(text_or_ids, add_special_tokens=True))
    return list(text_or_ids)


def _harmony_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    options: TemplateOptions,
) -> list[int]:
    return harmony_prompt_ids(
        tokenizer,
        messages,
        tools,
        add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message,
        add_special_tokens=options.add_special_tokens,
        **(options.template_kwargs or {}),
    )


# Template variables the render sets from the request's own fields, and functions Hugging Face
# gives every template: a request's chat_template_kwargs never set them.
_SUPPLIED = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
     "raise_exception", "strftime_now"}
)  # fmt: skip
# gpt-oss's prompt is harmony's system message, not a template's (vLLM renders it with
# openai_harmony): only its fields reach it, the reasoning effort, identity and date.
_HARMONY_VARIABLES = frozenset({"reasoning_effort", "model_identity", "current_date"})
_HARMONY_EFFORTS = ("low", "medium", "high")


def _template_kwargs(template: Any, kwargs: dict[str, Any], harmony: bool) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` that ``template`` (one, or named ones) reads:
    the others are dropped, as vLLM drops them (all kept but the supplied ones when the
    template cannot be parsed here; rendering says what is wrong with it)."""
    if harmony:
        effort = kwargs.get("reasoning_effort")
        if effort is not None and effort not in _HARMONY_EFFORTS:
            raise InvalidRequestError(
                f"gpt-oss takes low, medium or high, got {effort!r}", param="reasoning_effort"
            )
        return {k: v for k, v in kwargs.items() if k in _HARMONY_VARIABLES}
    texts = template.values() if isinstance(template, dict) else [template]
    read = [_read_variables(t) for t in texts if isinstance(t, str)]
    names = None if None in read else frozenset().union(*read)
    return {k: v for k, v in kwargs.items() if k not in _SUPPLIED and (names is None or k in names)}


class _GenerationTag(Extension):
    """Hugging Face's ``{% generation %}`` block (it marks the assistant's tokens for
    training), read as its body: templates that use it parse here."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's class attribute)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=16)
def _read_variables(template: str) -> frozenset[str] | None:
    """The undeclared variables of ``template`` (None: it does not parse)."""
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except TemplateError:
        return None


def _knows_developer_role(template: Any) -> bool:
    """vLLM's test: the template (any of several named ones) names the role."""
    texts = template.values() if isinstance(template, dict) else [template]
    return any('"developer"' in t or "'developer'" in t for t in texts if isinstance(t, str))


def developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``developer`` messages (OpenAI's newer name for ``system``) as ``system`` ones; when that
    leaves a system message past the first, all of them merged into one first message, their
    texts a blank line apart (vLLM's ``_consolidate_system_messages``: templates that want the
    system message first)."""
    if not any(m.get("role") == "developer" for m in messages):
        return messages
    renamed = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(renamed) if m["role"] == "system"]
    if systems == [0]:
        return renamed
    texts = [_text(renamed[i].get("content")) for i in systems]
    merged = {"role": "system", "content": "\n\n".join(t for t in texts if t)}
    return [merged, *(m for m in renamed if m["role"] != "system")]


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
    return content or ""


def chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    multimodal: MultiModalProcessor | None,
    placeholder: str | None,
    tools: list[dict[str, Any]] | None = None,
    options: TemplateOptions = TemplateOptions(),
) -> dict[str, Any]:
    """The core's prompt for chat ``messages``: ``{"prompt_token_ids": ...}``, plus
    ``mm_features`` when a message holds image parts (each rendered as ``placeholder``, then
    expanded to its image's tokens; ``placeholder`` None: a text-only model, which refuses
    them)."""
    text_messages, images = split_content_parts(messages, placeholder)
    ids = chat_prompt_ids(tokenizer, text_messages, tools, options)
    if not images or multimodal is None:
        return {"prompt_token_ids": ids}
    ids, features = multimodal.process(ids, {"image": images})
    return {"prompt_token_ids": ids, "mm_features": features}


def request_prompt(
    tokenizer: Any,
    request: GenerateRequest | EmbedRequest,
    multimodal: MultiModalProcessor | None,
    placeholder: str | None,
) -> Any:
    """The core's prompt for a request: chat messages by the template
    (``request_chat_prompt``), a text prompt tokenized (with the tokenizer's special tokens
    unless the request turns them off), or the ids it gives."""
    if isinstance(request, GenerateRequest) and request.messages is not None:
        return request_chat_prompt(tokenizer, request, multimodal, placeholder)
    if request.prompt_token_ids is not None:
        return {"prompt_token_ids": request.prompt_token_ids}
    prompt = request.prompt
    if isinstance(prompt, str) and prompt:
        special = request.add_special_tokens is not False  # None: the default, with them
        ids = tokenizer.encode(prompt, add_special_tokens=special)
        return {"prompt": prompt, "prompt_token_ids": ids}
    return prompt  # the core names what is wrong with it


def truncated_prompt(
    prompt: Any, request: GenerateRequest | EmbedRequest, max_model_len: int
) -> Any:
    """The prompt cut to the request's ``truncate_prompt_tokens``, as vLLM cuts it: -1 is as
    many as the model takes (one less for a generation, which needs room for a token); the
    last tokens are kept with ``truncation_side`` "left", the first with "right" (unset: "left"
    for a generation, "right" for a pooling input, the sides vLLM gives its tokenizer). A bound
    past ``max_model_len``, or a cut through a prompt's images, is a 400 naming the field."""
    keep, side = request.truncate_prompt_tokens, request.truncation_side
    if keep is None or not isinstance(prompt, dict):
        return prompt
    if not -1 <= keep <= max_model_len:
        raise InvalidRequestError(
            f"must be -1 (as many as fit) or 0 to the model's max_model_len {max_model_len}, "
            f"got {keep}",
            param="truncate_prompt_tokens",
        )
    if side not in (None, "left", "right"):
        raise InvalidRequestError(f"must be 'left' or 'right', got {side!r}", "truncation_side")
    generates = isinstance(request, GenerateRequest)
    if keep < 0:
        keep = max_model_len - 1 if generates else max_model_len
    ids = prompt["prompt_token_ids"]
    if keep >= len(ids):
        return prompt
    if "mm_features" in prompt:
        raise InvalidRequestError("would cut through the prompt's images",
                                  param="truncate_prompt_tokens")  # fmt: skip
    side = side or ("left" if generates else "right")
    return {"prompt_token_ids": ids[len(ids) - keep :] if side == "left" else ids[:keep]}


def with_template_defaults(request: GenerateRequest, defaults: dict[str, Any] | None) -> Any:
    """A chat request with the model's ``default_chat_template_kwargs`` under its own
    ``chat_template_kwargs``, as vLLM merges them: a request's value of None or "auto" is no
    value (the default stays, if there is one); other requests as they are."""
    own = request.chat_template_kwargs
    if request.messages is None or not (defaults or own):
        return request
    set_here = {k: v for k, v in (own or {}).items() if v is not None and v != "auto"}
    merged = {**(defaults or {}), **set_here}
    return msgspec.structs.replace(request, chat_template_kwargs=merged or None)


def request_chat_prompt(
    tokenizer: Any,
    request: GenerateRequest,
    multimodal: MultiModalProcessor | None,
    placeholder: str | None,
) -> dict[str, Any]:
    """``chat_prompt`` of a chat request, with its template options."""
    options = TemplateOptions(
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        add_special_tokens=bool(request.add_special_tokens),
        template_kwargs=request.chat_template_kwargs,
    )
    return chat_prompt(tokenizer, request.messages or [], multimodal, placeholder,
                       request.tools, options)  # fmt: skip
