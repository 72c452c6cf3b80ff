"""Anthropic's Messages API request bodies (``POST /v1/messages`` and ``POST
/v1/messages/count_tokens``) as pydantic models: Anthropic's field names, then the vLLM sampling
extensions the chat route also takes (a client sends them as extra body fields).

Content blocks (``text``, ``image``, ``tool_use``, ``tool_result``, ``thinking``) are kept as
plain JSON here: ``cluster.api.anthropic_payloads`` reads each one with an error naming its path
(``messages.2.content.0.type``) rather than a union's wall of validation errors. Undeclared fields
go through ``check_extra_fields`` with the Messages table (``anthropic_payloads``): the few that
would change the output are a 400 naming them, the rest are ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from cluster.api.openai_models import OrNull, Text, TokenId, _Model, _ranged

_INT64 = {"minimum": -(2**63), "maximum": 2**63 - 1}
# Anthropic's least thinking budget.
MIN_THINKING_BUDGET = 1024
# Anthropic's temperature range is [0, 1] (the engine's, for the OpenAI routes, [0, 2]).
MAX_TEMPERATURE = 1


class AnthropicMessage(_Model):
    role: Literal["user", "assistant"]
    content: Text | list[dict[str, Any]]


class AnthropicTool(_Model):
    """A client tool; ``type`` is absent or ``custom`` (server tools, which have no
    ``input_schema``, are a 400 naming them). A client tool's ``input_schema`` is required."""

    name: Text
    description: Text | None = None
    input_schema: dict[str, Any] | None = None
    type: Text | None = None


class AnthropicToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Model):
    """``enabled`` (with its budget) or ``adaptive``: the model's think block comes back as
    ``thinking`` content; ``disabled``: the template is asked to skip it (``enable_thinking``).
    The budget is not enforced: the engine has no per-block token limit."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = _ranged(None, minimum=MIN_THINKING_BUDGET)


class OutputFormat(_Model):
    """Structured outputs: the reply is JSON matching ``schema`` (the chat's ``response_format``
    ``json_schema``)."""

    type: Literal["json_schema"]
    # ``schema`` shadows a BaseModel attribute: the alias keeps Anthropic's field name.
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    format: OutputFormat | None = None
    # The chat template's ``reasoning_effort`` (gpt-oss's "Reasoning: ..." line), as vLLM's.
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # anthropic's values


class CountTokensRequest(_Model):
    """``POST /v1/messages/count_tokens``: the prompt's fields of a Messages request."""

    model: Text
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Text | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. ``metadata`` and ``service_tier`` are accepted and ignored;
    ``output_format`` is the older (beta) place of ``output_config.format``."""

    max_tokens: int = _ranged(..., minimum=1)
    stop_sequences: list[Text] | None = None
    temperature: float | None = _ranged(None, minimum=0, maximum=MAX_TEMPERATURE)
    top_p: float | None = _ranged(None, exclusiveMinimum=0, maximum=1)
    top_k: int | None = _ranged(None, minimum=0)
    stream: OrNull[bool] = False
    output_format: OutputFormat | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Text | None = None
    # vLLM's sampling extensions, as on the chat route.
    seed: int | None = _ranged(None, **_INT64)
    min_p: float | None = _ranged(None, minimum=0, maximum=1)
    presence_penalty: float | None = _ranged(None, minimum=-2, maximum=2)
    frequency_penalty: float | None = _ranged(None, minimum=-2, maximum=2)
    repetition_penalty: float | None = _ranged(None, exclusiveMinimum=0)
    stop_token_ids: list[TokenId] | None = None
    min_tokens: int | None = _ranged(None, minimum=0)
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: Text | None = None
    timeout: float | None = _ranged(None, exclusiveMinimum=0)


# The sampling fields passed to the chat request under the same name when given.
SAMPLING_PASSTHROUGH = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "stop_token_ids", "min_tokens", "ignore_eos",
    "logit_bias", "cache_salt", "timeout",
)  # fmt: skip

__all__ = [
    "MAX_TEMPERATURE",
    "MIN_THINKING_BUDGET",
    "SAMPLING_PASSTHROUGH",
    "AnthropicMessage",
    "AnthropicTool",
    "AnthropicToolChoice",
    "CountTokensRequest",
    "MessagesRequest",
    "OutputConfig",
    "OutputFormat",
    "ThinkingConfig",
]
