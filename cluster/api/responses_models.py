"""The OpenAI Responses API's request body (``POST /v1/responses``) as a pydantic model:
OpenAI's field names, then the vLLM sampling extensions the chat route also takes.

``input`` items, ``tools`` and ``tool_choice`` are kept as plain JSON here: they come in many
shapes (messages, function calls and their outputs, output items a client sends back, built-in
tools), and ``cluster.api.responses_payloads`` reads each one with an error naming its path
(``input.2.content.0.type``) rather than a union's wall of validation errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from cluster.api.openai_models import (
    JsonSchemaFormat,
    OrNull,
    StructuredOutputs,
    Text,
    TokenId,
    _Model,
    _ranged,
)

_INT64 = {"minimum": -(2**63), "maximum": 2**63 - 1}


class TextFormat(_Model):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its fields inline
    (``{"type": "json_schema", "name": ..., "schema": ..., "strict": ...}``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Text = "response"
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def chat_response_format(self) -> dict[str, Any] | None:
        """The chat request's ``response_format`` for this format (None for plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        fields = {"name": self.name, "description": self.description,
                  "schema": self.json_schema, "strict": self.strict}  # fmt: skip
        spec = JsonSchemaFormat.model_validate(fields)
        return {"type": "json_schema", "json_schema": spec.model_dump(by_alias=True)}

    def echo(self) -> dict[str, Any]:
        """As the response object states it."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name, "description": self.description,
                "schema": self.json_schema, "strict": self.strict}  # fmt: skip


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Model):
    """``POST /v1/responses``. Undeclared fields: harmless ones (``reasoning``, ``service_tier``,
    ``prompt_cache_key``, ...) are ignored (``reasoning`` is echoed); the ones that would change
    the output and are not supported are a 400 naming them
    (``cluster.api.responses_payloads.UNSUPPORTED_RESPONSE_FIELDS``); ``include`` must hold
    OpenAI's values, output text logprobs refused (``responses_payloads.check_request``)."""

    model: Text
    # Optional as in OpenAI's API: a continuation (previous_response_id) may add none.
    input: Text | list[dict[str, Any]] | None = None
    instructions: Text | None = None
    max_output_tokens: int | None = _ranged(None, minimum=1)
    temperature: float | None = _ranged(None, minimum=0, maximum=2)
    top_p: float | None = _ranged(None, exclusiveMinimum=0, maximum=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: OrNull[bool] = False
    # OpenAI's default: the response is kept for ``previous_response_id`` and GET.
    store: OrNull[bool] = True
    previous_response_id: Text | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    top_logprobs: int | None = _ranged(None, minimum=0)  # only 0: logprobs are not returned
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's sampling extensions, as on the chat route.
    seed: int | None = _ranged(None, **_INT64)
    top_k: int | None = _ranged(None, minimum=-1)
    min_p: float | None = _ranged(None, minimum=0, maximum=1)
    presence_penalty: float | None = _ranged(None, minimum=-2, maximum=2)
    frequency_penalty: float | None = _ranged(None, minimum=-2, maximum=2)
    repetition_penalty: float | None = _ranged(None, exclusiveMinimum=0)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: int | None = _ranged(None, minimum=0)
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: Text | None = None
    timeout: float | None = _ranged(None, exclusiveMinimum=0)
    include_stop_str_in_output: bool | None = None
    bad_words: list[Text] | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = _ranged(None, **_INT64)  # vLLM's, as on the chat route
    # vLLM's: the response's id (a later one with the same id replaces it in the store).
    request_id: Text | None = None
    # vLLM's: a grammar, regex, choice or schema over the output (not with text.format).
    structured_outputs: StructuredOutputs | None = None


# The sampling fields passed to the chat request under the same name when given.
SAMPLING_PASSTHROUGH = (
    "temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "min_tokens", "ignore_eos", "logit_bias",
    "cache_salt", "timeout", "user", "structured_outputs", "include_stop_str_in_output",
    "bad_words", "skip_special_tokens", "priority",
)  # fmt: skip

__all__ = ["SAMPLING_PASSTHROUGH", "ResponsesRequest", "TextConfig", "TextFormat"]
