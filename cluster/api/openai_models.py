"""The OpenAI API's request bodies as pydantic models: OpenAI's field names (vLLM's extensions
after them), each range stated in the OpenAPI schema for clients and fuzzers. The engine
re-checks every range, so gRPC and offline requests get the same 400s."""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError


def _unicode_text(text: str) -> str:
    # JSON can escape a lone surrogate ("\\ud800"); it is no text: the tokenizer, the
    # prefix-cache hash and the UTF-8 error body that echoes a field all fail on it.
    try:
        text.encode()
    except UnicodeEncodeError:
        raise PydanticCustomError(
            "invalid_unicode", "must be valid Unicode text (no lone surrogates)"
        ) from None
    return text


# Every string field of a request.
Text = Annotated[str, AfterValidator(_unicode_text)]

_T = TypeVar("_T")
_NULL_MEANS_DEFAULT = object()
# A field OpenAI's schema makes nullable (``temperature``, ``n``, ``stream``, ...) whose null
# means "not given", its default, as in vLLM: clients send null for unset values (the openai
# client's ``temperature=None``). The model never holds None for it.
OrNull = Annotated[_T | None, _NULL_MEANS_DEFAULT]


def _ranged(default: Any, **bounds: int | float) -> Any:
    """A field whose range the OpenAPI schema states (JSON Schema ``minimum``, ``maximum``,
    ``exclusiveMinimum``) for clients and fuzzers. The engine checks it, as for gRPC and
    offline requests, and its 400 names the field; caps that a server sets (``max_n``,
    ``max_logprobs``, ``max_model_len``) are not in the schema."""
    return Field(default, json_schema_extra=bounds)


_INT64 = {"minimum": -(2**63), "maximum": 2**63 - 1}
# vLLM's truncation_side: "left" keeps a truncated prompt's last tokens, "right" its first;
# unset, the tokenizer's side.
TruncationSide = Literal["left", "right"]
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0})]


class _Model(BaseModel):
    # Fields a model does not declare are kept (``model_extra``) and checked by
    # ``cluster.api.openai_payloads.check_extra_fields``: clients fill in harmless ones
    # (``metadata``, ``store``, ``service_tier``) that are ignored, as vLLM does; the few known
    # to change the output are a 400 naming them.
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        """``null`` in an ``OrNull`` field means "not given": its default."""
        if not isinstance(data, dict):
            return data
        names = _null_means_default(cls)
        if not any(data.get(name, ...) is None for name in names):
            return data
        return {k: v for k, v in data.items() if not (v is None and k in names)}


@functools.cache
def _null_means_default(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` (by name and alias) declared ``OrNull``."""
    names: set[str] = set()
    for name, info in model.model_fields.items():
        if any(m is _NULL_MEANS_DEFAULT for m in info.metadata):
            names.update({name, info.alias or name})
    return frozenset(names)


class StreamOptions(_Model):
    include_usage: OrNull[bool] = False
    # vLLM's: every chunk carries the usage so far (only with include_usage).
    continuous_usage_stats: OrNull[bool] = False


class JsonSchemaFormat(_Model):
    name: Text = "response"
    description: Text | None = None
    # ``schema`` shadows a BaseModel attribute: the alias keeps OpenAI's field name.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Model):
    """vLLM's ``structured_outputs`` (``StructuredOutputsParams``): exactly one of these."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class SamplingFields(_Model):
    """Fields every generation request shares (OpenAI names, vLLM extensions last)."""

    model: Text
    temperature: OrNull[float] = _ranged(1.0, minimum=0, maximum=2)
    top_p: OrNull[float] = _ranged(1.0, exclusiveMinimum=0, maximum=1)
    n: OrNull[int] = _ranged(1, minimum=1)
    stream: OrNull[bool] = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = _ranged(None, **_INT64)
    presence_penalty: OrNull[float] = _ranged(0.0, minimum=-2, maximum=2)
    frequency_penalty: OrNull[float] = _ranged(0.0, minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: Text | None = None
    top_k: OrNull[int] = _ranged(0, minimum=-1)  # 0 and -1: disabled
    min_p: OrNull[float] = _ranged(0.0, minimum=0, maximum=1)
    repetition_penalty: OrNull[float] = _ranged(1.0, exclusiveMinimum=0)
    min_tokens: int = _ranged(0, minimum=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[Text] | None = None
    allowed_token_ids: list[TokenId] | None = None  # vLLM's: only these can be sampled
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: each prompt token's logprob and its top-k (the response's ``prompt_logprobs``);
    # above 0 not with ``stream``, as in vLLM.
    prompt_logprobs: int | None = _ranged(None, minimum=0)
    # Requests with different salts never share prefix-cache blocks (tenant isolation).
    cache_salt: Text | None = None
    # Seconds: past it the request is aborted, its KV blocks freed, and the client gets a 408.
    timeout: float | None = _ranged(None, exclusiveMinimum=0)
    # vLLM's: lower is served first under the model's ``scheduling_policy: priority`` (ignored
    # under FCFS); the ``X-Vllm-Priority`` header, when given, replaces it.
    priority: int = _ranged(0, **_INT64)
    # vLLM's: keep this many of the prompt's tokens (-1: as many as the model takes).
    truncate_prompt_tokens: int | None = _ranged(None, minimum=-1)
    truncation_side: TruncationSide | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* names (one of them per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    # 0 only with echo: the prompt scored, nothing generated (lm-evaluation-harness).
    max_tokens: OrNull[int] = _ranged(16, minimum=0)  # null: 16, as vLLM
    logprobs: int | None = _ranged(None, minimum=0)
    echo: OrNull[bool] = False
    best_of: int | None = None
    suffix: Text | None = None
    # vLLM's: the tokenizer's special tokens (BOS) around the prompt text.
    add_special_tokens: bool = True


class FunctionCall(_Model):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(_Model):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[dict[str, Any]] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool's result answers this call
    # An assistant's earlier reasoning, as responses carry it: a template may show it again
    # (harmony keeps it before the calls of an unfinished turn). ``reasoning`` is vLLM 0.32's
    # name for it (its responses return that): read into reasoning_content, which the template
    # sees.
    reasoning_content: Text | None = None
    reasoning: Text | None = Field(None, exclude=True)

    @field_validator("reasoning")
    @classmethod
    def _one_reasoning(cls, reasoning: str | None, info: ValidationInfo) -> str | None:
        content = info.data.get("reasoning_content")
        if reasoning is not None and content is not None and reasoning != content:
            raise PydanticCustomError(
                "reasoning_conflict",
                "differs from reasoning_content (two names of one field: send one)",
            )
        return reasoning

    @model_validator(mode="after")
    def _reasoning_is_reasoning_content(self) -> ChatMessage:
        if self.reasoning_content is None:
            self.reasoning_content = self.reasoning
        return self


class FunctionDefinition(_Model):
    name: Text = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: Text


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = _ranged(None, minimum=1)
    max_completion_tokens: int | None = _ranged(None, minimum=1)
    logprobs: OrNull[bool] = False
    top_logprobs: int | None = _ranged(None, minimum=0)
    # Declared so that their 400 says why: only the model's own template is ever rendered.
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's RAG documents ({"title": ..., "text": ...}): the template's ``documents`` variable,
    # over chat_template_kwargs' (a template that does not read it renders without them).
    documents: list[dict[str, str]] | None = None
    # For the model's chat template, as vLLM passes it (gpt-oss's "Reasoning: ..." line).
    # vLLM 0.32's values; a model's template (or gpt-oss's harmony prompt) may take fewer.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    # vLLM's: false renders the messages without the template's generation prompt (the
    # assistant turn's opening); continue_final_message leaves the last (assistant) message
    # open for the output to continue (a prefill), without one either.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the tokenizer's special tokens (BOS) on top of those the template writes.
    add_special_tokens: bool = False
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: OrNull[bool] = True
    # vLLM's: false leaves a reasoning model's reasoning (and the logprobs that would show it)
    # out of the response.
    include_reasoning: bool = True
    # vLLM's: the answer starts with the last message's text when that message has the
    # answer's role (``chat_echo``).
    echo: OrNull[bool] = False


class EmbeddingRequest(_Model):
    model: Text
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = _ranged(None, minimum=1)
    # vLLM's: the tokenizer's special tokens (BOS) around each text input.
    add_special_tokens: bool = True
    user: Text | None = None
    truncate_prompt_tokens: int | None = _ranged(None, minimum=-1)  # as a generation's
    truncation_side: TruncationSide | None = None


class TokenizeRequest(_Model):
    """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` (with the chat route's template
    options). ``model`` may be left out when one model is served."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # None: the route's default, True for a prompt, False for messages (the template has them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Declared so that their 400 says why, as on the chat route.
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    # Also the token strings (the tokenizer's pieces: "<s>", "▁the").
    return_token_strs: OrNull[bool] = False


class DetokenizeRequest(_Model):
    model: Text | None = None
    tokens: list[TokenId]
