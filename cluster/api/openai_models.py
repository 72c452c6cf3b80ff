"""The OpenAI API's request bodies as pydantic models: OpenAI's field names (vLLM's extensions
after them), each range stated in the OpenAPI schema for clients and fuzzers. The engine
re-checks every range, so gRPC and offline requests get the same 400s."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
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


def _ranged(default: Any, **bounds: int | float) -> Any:
    """A field whose range the OpenAPI schema states (JSON Schema ``minimum``, ``maximum``,
    ``exclusiveMinimum``) for clients and fuzzers. The engine checks it, as for gRPC and
    offline requests, and its 400 names the field; caps that a server sets (``max_n``,
    ``max_logprobs``, ``max_model_len``) are not in the schema."""
    return Field(default, json_schema_extra=bounds)


_INT64 = {"minimum": -(2**63), "maximum": 2**63 - 1}
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0})]


class _Model(BaseModel):
    # Fields a model does not declare are kept (``model_extra``) and checked by
    # ``cluster.api.openai_payloads.check_extra_fields``: clients fill in harmless ones
    # (``metadata``, ``store``, ``service_tier``) that are ignored, as vLLM does; the few known
    # to change the output are a 400 naming them.
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Model):
    include_usage: bool = False


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
    temperature: float = _ranged(1.0, minimum=0)
    top_p: float = _ranged(1.0, exclusiveMinimum=0, maximum=1)
    n: int = _ranged(1, minimum=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = _ranged(None, **_INT64)
    presence_penalty: float = _ranged(0.0, minimum=-2, maximum=2)
    frequency_penalty: float = _ranged(0.0, minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: Text | None = None
    top_k: int = _ranged(0, minimum=-1)  # 0 and -1: disabled
    min_p: float = _ranged(0.0, minimum=0, maximum=1)
    repetition_penalty: float = _ranged(1.0, exclusiveMinimum=0)
    min_tokens: int = _ranged(0, minimum=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[Text] | None = None
    skip_special_tokens: bool = True
    # Requests with different salts never share prefix-cache blocks (tenant isolation).
    cache_salt: Text | None = None
    # Seconds: past it the request is aborted, its KV blocks freed, and the client gets a 408.
    timeout: float | None = _ranged(None, exclusiveMinimum=0)
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
    max_tokens: int | None = _ranged(16, minimum=0)
    logprobs: int | None = _ranged(None, minimum=0)
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None


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
    # (harmony keeps it before the calls of an unfinished turn).
    reasoning_content: Text | None = None


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
    logprobs: bool = False
    top_logprobs: int | None = _ranged(None, minimum=0)
    # Declared so that their 400 says why: only the model's own template is ever rendered.
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # For the model's chat template, as vLLM passes it (gpt-oss's "Reasoning: ..." line).
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's: the last (assistant) message is a beginning the output continues.
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class EmbeddingRequest(_Model):
    model: Text
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = _ranged(None, minimum=1)
    user: Text | None = None


class TokenizeRequest(_Model):
    model: Text
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)


class DetokenizeRequest(_Model):
    model: Text
    tokens: list[TokenId]
