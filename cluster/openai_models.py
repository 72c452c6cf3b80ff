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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
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


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = _ranged(16, minimum=1)
    logprobs: int | None = _ranged(None, minimum=0)
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[dict[str, Any]] | None = None
    name: Text | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = _ranged(None, minimum=1)
    max_completion_tokens: int | None = _ranged(None, minimum=1)
    logprobs: bool = False
    top_logprobs: int | None = _ranged(None, minimum=0)
    # Declared so that their 400 says why: only the model's own template is ever rendered.
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Strict):
    model: Text
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)


class DetokenizeRequest(_Strict):
    model: Text
    tokens: list[TokenId]
