"""The ingress <-> ``LLMServer`` replica protocol: typed msgspec messages, one error table.

    ingress ── GenerateRequest ──────────────▶ LLMServer.generate (a Serve streaming handle call)
            ◀── StreamStart                    after validation, before any token
            ◀── StreamDelta …                  the choices with something new, one per step
            ◀── StreamError                    instead of StreamStart, or last (503, 408)

With ``GenerateRequest.channel`` (the ingress's ``cluster.serving.token_channel``) and a replica
whose core runs in a head actor, the ``StreamDelta`` items do not travel on this stream: the head
writes each step's deltas for all of that ingress's requests to the ingress in one message, and
``StreamStart.head`` names that head (a request's part of it is the same ``StreamDelta``). The
stream then carries its start, its end, and any ``StreamError``.
    ingress ── EmbedRequest ─────────────────▶ LLMServer.embed (a unary handle call)
            ◀── EmbedResult | StreamError

A request's validation error arrives as the first item, so a streaming client still gets a
clean 400. ``StreamError.status`` picks everything a client sees of an error from ``ERRORS``:
the OpenAI error type, and the gRPC status code (by name, so this module needs no grpc).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from engine.client.core_messages import ChoiceDelta
from engine.outputs import Logprob

# status -> (OpenAI error "type", gRPC status code name)
ERRORS: dict[int, tuple[str, str]] = {
    400: ("BadRequestError", "INVALID_ARGUMENT"),
    401: ("AuthenticationError", "UNAUTHENTICATED"),
    404: ("NotFoundError", "NOT_FOUND"),
    405: ("BadRequestError", "INVALID_ARGUMENT"),
    408: ("RequestTimeoutError", "DEADLINE_EXCEEDED"),
    413: ("RequestTooLargeError", "RESOURCE_EXHAUSTED"),
    429: ("RateLimitError", "RESOURCE_EXHAUSTED"),
    431: ("RequestHeaderFieldsTooLargeError", "INVALID_ARGUMENT"),
    503: ("ServiceUnavailableError", "UNAVAILABLE"),
}


def error_type(status: int) -> str:
    return ERRORS.get(status, ("APIError", "INTERNAL"))[0]


def grpc_code_name(status: int, code: str | None = None) -> str:
    """An overloaded model (a full waiting queue, back-pressure) is RESOURCE_EXHAUSTED."""
    if code == "overloaded":
        return "RESOURCE_EXHAUSTED"
    return ERRORS.get(status, ("APIError", "INTERNAL"))[1]


def new_request_id() -> str:
    return uuid.uuid4().hex


class GenerateRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One generation: exactly one of ``prompt``, ``prompt_token_ids`` or ``messages``;
    ``params`` are ``SamplingParams`` fields by name (the server checks names and ranges)."""

    params: dict[str, Any] = {}
    prompt: Any = None  # a string; anything else is a 400 from the server, naming the field
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    cache_salt: str | None = None
    timeout: float | None = None  # seconds; past it: aborted, then a 408
    priority: int = 0  # vLLM's: lower first under the priority policy (the engine checks it)
    # The engine's id of the request; the ingress registers it with its token channel before
    # the call, so it is made here, whoever builds the request (ingress, gRPC, tests).
    request_id: str = msgspec.field(default_factory=new_request_id)
    # The prompt's text (and its logprobs, when params ask for prompt_logprobs) comes back in
    # StreamStart: OpenAI's echo.
    echo: bool = False
    # OpenAI tool definitions for the chat template ({"type": "function", "function": ...}).
    tools: list[dict[str, Any]] | None = None
    # Variables for the chat template from the request's own fields (reasoning_effort).
    chat_template_kwargs: dict[str, Any] | None = None
    # False: the template renders the messages without its generation prompt (the opening
    # of the assistant's turn).
    add_generation_prompt: bool = True
    # The last message is an assistant's beginning that the output continues (a prefill): the
    # template renders it open, with no generation prompt after it.
    continue_final_message: bool = False
    # The tokenizer's special tokens (BOS) around the text: None is the default of the
    # prompt's kind, True for ``prompt``, False for ``messages`` (their template writes them).
    add_special_tokens: bool | None = None
    # "auto": the replica checks that its model reads tool calls (enable_auto_tool_choice) and
    # names its tool_call_parser in StreamStart. Forced calls arrive as structured outputs.
    tool_choice: str | None = None
    # A LoRA adapter of the model (the OpenAI model "<model>:<adapter>"); None: the base model.
    adapter: str | None = None
    # The ingress's token channel (its sink name at the heads); None: deltas on the stream.
    channel: str | None = None
    # vLLM's prompt truncation: keep this many of its tokens (-1: as many as fit), the last ones
    # ("left") or the first ("right"; None: the tokenizer's side).
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None


# Per token: rows of [token_id, text, logprob, rank], the sampled token first, then the top-k.
# The first prompt token has no logprob: its one row is [token_id, text, None, None].
TokenLogprobs = list[list[Any]]


class StreamStart(msgspec.Struct, tag="start", omit_defaults=True):
    prompt_tokens: int
    n: int = 1
    prompt_text: str | None = None  # with echo
    prompt_logprobs: list[TokenLogprobs] | None = None  # with prompt_logprobs, one per token
    tool_call_parser: str | None = None  # with tool_choice "auto"
    replica_id: str | None = None  # the replica serving it (a response header)
    # The head actor whose channel sink carries the deltas (None: they follow on this stream).
    head: str | None = None
    # A chat with the model's reasoning_parser (cluster.api.reasoning_parsers): its name, and
    # whether the output starts inside a think block, as the prompt's think tags say (None: the
    # parser's default).
    reasoning_parser: str | None = None
    in_reasoning: bool | None = None
    # Whether the model reports the prompt's tokens read from the prefix cache (each
    # StreamDelta's num_cached_tokens) in usage (enable_prompt_tokens_details).
    prompt_tokens_details: bool = False
    # What it samples with, for a model with sampling defaults (generation_config): a Responses
    # object names them.
    temperature: float | None = None
    top_p: float | None = None


class StreamDelta(msgspec.Struct, tag="delta"):
    """The engine core's own deltas, as they left it (logprobs as ``Logprob``s by token id):
    the ingress renders them, OpenAI rows included (``logprob_rows``)."""

    choices: list[ChoiceDelta]
    # The last delta of a prefill held for a remote decode (NixlConnector): where its blocks
    # are (RequestOutput.kv_transfer_params); the ingress hands them to the decode pool.
    kv_transfer_params: dict[str, Any] | None = None
    # The prompt's tokens read from the prefix cache (known once the prompt is scheduled).
    num_cached_tokens: int = 0


class StreamError(msgspec.Struct, tag="error"):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None  # seconds, for a Retry-After header

    @property
    def error_type(self) -> str:
        return error_type(self.status)


StreamItem = StreamStart | StreamDelta | StreamError


def unavailable(message: str) -> StreamError:
    """A 503 the client may retry: the model's replica or engine failed under the request."""
    return StreamError(503, message, None, "unavailable")


def replica_failed(model: str) -> StreamError:
    """The last item of a stream whose replica failed (its process killed, its node lost)."""
    return unavailable(f"the replica serving {model!r} failed; retry the request")


def logprob_rows(entry: dict[int, Logprob] | None) -> TokenLogprobs:
    """[token_id, text, logprob, rank] per token of a position, the chosen token first."""
    return [[t, lp.decoded_token or "", lp.logprob, lp.rank] for t, lp in (entry or {}).items()]


class EmbedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One pooling input: ``prompt`` (text, tokenized by the server) or ``prompt_token_ids``.
    ``task`` (``embed`` or ``classify``), ``normalize``, ``dimensions`` and ``activation`` are
    ``PoolingParams`` fields. A list of inputs (OpenAI's ``input``) is one call per input: the
    ingress fans them out and gathers the results."""

    prompt: Any = None  # a string; anything else is a 400 from the server, naming the field
    prompt_token_ids: list[int] | None = None
    add_special_tokens: bool = True  # the tokenizer's special tokens (BOS) around ``prompt``
    task: str = "embed"
    normalize: bool = True
    dimensions: int | None = None
    activation: bool = True
    request_id: str = msgspec.field(default_factory=new_request_id)
    truncate_prompt_tokens: int | None = None  # as GenerateRequest's
    truncation_side: str | None = None


class EmbedResult(msgspec.Struct):
    """The input's embedding, or its class probabilities (float32 values), how many tokens its
    prompt had (usage) and, for ``classify``, the most likely class's name."""

    embedding: list[float]
    prompt_tokens: int
    label: str | None = None


class ScoreRequest(msgspec.Struct, kw_only=True):
    """Text pairs to score (``engine.client.scoring``): one ``text_1`` against every
    ``text_2``, or as many of each."""

    text_1: list[str]
    text_2: list[str]
    request_id: str = msgspec.field(default_factory=new_request_id)


class ScoreResult(msgspec.Struct):
    """One score per pair, in order, and the tokens of every prompt computed (usage)."""

    scores: list[float]
    prompt_tokens: int


class TokenizeResult(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # the tokenizer's pieces, when asked for


class DetokenizeResult(msgspec.Struct):
    prompt: str


__all__ = [
    "ERRORS",
    "DetokenizeResult",
    "EmbedRequest",
    "EmbedResult",
    "GenerateRequest",
    "ScoreRequest",
    "ScoreResult",
    "StreamDelta",
    "StreamError",
    "StreamItem",
    "StreamStart",
    "TokenLogprobs",
    "TokenizeResult",
    "error_type",
    "grpc_code_name",
    "logprob_rows",
    "new_request_id",
    "replica_failed",
    "unavailable",
]
