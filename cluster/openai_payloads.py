"""OpenAI request -> the ``GenerateRequest`` a model replica serves: OpenAI's fields mapped to
the engine's ``SamplingParams`` names, chat messages flattened for the chat template. Fields
the engine does not support are a 400 naming them."""

from __future__ import annotations

from typing import Any

from cluster.api_errors import APIError
from cluster.openai_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from cluster.protocol import GenerateRequest

# Fields passed to the engine under the same name when they differ from its default (the engine
# checks their ranges and caps, and its 400s name them).
_SAME_NAME_FIELDS = (
    "n", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "stop_token_ids", "include_stop_str_in_output", "logit_bias", "bad_words",
)  # fmt: skip


def sampling_params(req: SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed with stream: true", "stream_options")
    params: dict[str, Any] = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_tokens": max_tokens,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
    }
    defaults = SamplingFields.model_fields
    for name in _SAME_NAME_FIELDS:
        value = getattr(req, name)
        if value != defaults[name].default:
            params[name] = value
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    return params


def completion_payload(req: CompletionRequest) -> GenerateRequest:
    # best_of = n samples n and returns them all; ranking more samples than returned is not done.
    if req.best_of is not None and req.best_of not in (1, req.n):
        raise APIError(400, f"best_of: only best_of = n ({req.n}) is supported", "best_of",
                       "unsupported")  # fmt: skip
    for name, bad in {"echo": req.echo, "suffix": bool(req.suffix)}.items():
        if bad:
            raise APIError(400, f"{name}: not supported", name, "unsupported")
    params = sampling_params(req, req.max_tokens)
    if req.logprobs is not None:
        params["logprobs"] = req.logprobs
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "prompt: exactly one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return GenerateRequest(params=params, prompt_token_ids=prompt, **request_extras(req))
    return GenerateRequest(params=params, prompt=prompt, **request_extras(req))


def chat_payload(req: ChatCompletionRequest) -> GenerateRequest:
    for name in ("chat_template", "chat_template_kwargs"):
        if getattr(req, name) is not None:
            raise APIError(400, f"{name}: request-supplied chat templates are not accepted; the "
                           "model's own template is used", name, "unsupported")  # fmt: skip
    max_tokens = req.max_completion_tokens
    max_tokens = max_tokens if max_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs: true", "top_logprobs")
    if req.logprobs:
        params["logprobs"] = req.top_logprobs or 0
    return GenerateRequest(
        params=params, messages=chat_messages(req.messages), **request_extras(req)
    )


def request_extras(req: SamplingFields) -> dict[str, Any]:
    """Per-request settings beside the sampling parameters (the server checks them)."""
    extras = {"cache_salt": req.cache_salt, "timeout": req.timeout}
    return {k: v for k, v in extras.items() if v is not None}


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template: content parts (``[{"type": "text", "text": ...}]``)
    joined into one string; parts other than text are not supported (400)."""
    out = []
    for i, message in enumerate(messages):
        entry = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            texts = []
            for j, part in enumerate(message.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    param = f"messages.{i}.content.{j}"
                    raise APIError(400, f"{param}: only text parts are supported", param)
                texts.append(part["text"])
            entry["content"] = "".join(texts)
        out.append(entry)
    return out
