"""What the engine returns per request (vLLM's ``RequestOutput`` / ``CompletionOutput``, and
``PoolingRequestOutput`` / ``PoolingOutput`` for embedding requests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One token's raw log-probability, its 1-based rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the chosen token first, then the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of a request's n samples. ``cumulative_logprob`` (sum of the sampled tokens' raw
    logprobs) and ``logprobs`` are set only when the request asked for ``logprobs``."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # n of them, ordered by index
    finished: bool
    # One entry per prompt token (the first is None), when the request asked for them.
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # NixlConnector, on a prefill engine (vLLM's field): what a decode engine needs to read
    # this request's prompt blocks (its request's extra_args["kv_transfer_params"]).
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class PoolingOutput:
    """The pooled vector of a prompt's final hidden states (float32 values, L2-normalised
    unless the request's ``PoolingParams.normalize`` is False)."""

    data: list[float]

    @property
    def embedding(self) -> list[float]:
        """vLLM's ``EmbeddingOutput.embedding``: the same vector."""
        return self.data

    @property
    def probs(self) -> list[float]:
        """vLLM's ``ClassificationOutput.probs``: a classify request's class scores."""
        return self.data

    @property
    def score(self) -> float:
        """vLLM's ``ScoringOutput.score``: a one-class score (or a pair's cosine)."""
        return self.data[0]


@dataclass
class PoolingRequestOutput:
    """A pooling (embedding) request's one output, produced once its whole prompt is computed.
    ``outputs`` is None when the request was aborted first (``finish_reason`` "abort")."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None
    finished: bool = True
    prompt: str | None = None
    finish_reason: str | None = "stop"  # "stop" | "abort"
    num_cached_tokens: int = 0


# vLLM's names for the same objects when the task is "embed".
EmbeddingOutput = PoolingOutput
EmbeddingRequestOutput = PoolingRequestOutput
# ... and when it is "classify" or "score".
ClassificationOutput = PoolingOutput
ClassificationRequestOutput = PoolingRequestOutput
ScoringOutput = PoolingOutput
ScoringRequestOutput = PoolingRequestOutput
