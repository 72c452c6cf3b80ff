"""A request's inputs for the engine, on the model replica's front (``LLMServer``): its sampling
dict as ``SamplingParams``, and chat messages as prompt ids by the model's chat template; for a
vision-language model, a chat's image parts (data URLs) decoded and preprocessed here, on the
front, so the head receives pixels and expanded prompt ids (``chat_prompt``). Errors are
``InvalidRequestError``s naming the field, which the front returns as 400s."""

from __future__ import annotations

import logging
from typing import Any

from jinja2 import TemplateError

from engine.errors import InvalidRequestError
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


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """The prompt ids of chat ``messages`` by the model's chat template (a 400 on ``messages``
    when the template rejects them); ``continue_final_message``: the last message left open for
    the output to continue, instead of a generation prompt after it."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model has no chat template", param="messages")
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=False,
            **(template_kwargs or {}),
        )
    except TemplateError as exc:  # the template's raise_exception: roles, order
        raise InvalidRequestError(f"the chat template rejected them: {exc}", "messages") from exc
    except Exception as exc:  # anything else may quote internals: the log has it
        logger.exception("chat template failed")
        raise InvalidRequestError("the chat template rejected them", "messages") from exc
    return list(ids)


def chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    multimodal: MultiModalProcessor | None,
    placeholder: str | None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> dict[str, Any]:
    """The core's prompt for chat ``messages``: ``{"prompt_token_ids": ...}``, plus
    ``mm_features`` when a message holds image parts (each rendered as ``placeholder``, then
    expanded to its image's tokens; ``placeholder`` None: a text-only model, which refuses
    them)."""
    text_messages, images = split_content_parts(messages, placeholder)
    ids = chat_prompt_ids(tokenizer, text_messages, tools, template_kwargs, continue_final_message)
    if not images or multimodal is None:
        return {"prompt_token_ids": ids}
    ids, features = multimodal.process(ids, {"image": images})
    return {"prompt_token_ids": ids, "mm_features": features}
