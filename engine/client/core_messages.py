"""The messages between the engine core (``engine.client.core_loop``) and its front
(``engine.client.async_llm_engine``): msgspec structs with an explicit msgpack codec, so the same
messages serve a core on a thread and a core in another process (``cluster.serving.head_actor``).

    front ── AddRequest ──▶ core          core ── StepOutputs (one per step) ──▶ front
          ◀── AddResult ───                     RequestDelta per request, ChoiceDelta per choice
                                                (a pooling request: one RequestDelta, embedding)
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStateError,
    InvalidRequestError,
    RequestFailedError,
)
from engine.lora_request import LoRARequest
from engine.multimodal.inputs import MultiModalFeature
from engine.outputs import Logprob
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, kw_only=True):
    """A request for the core. The front sends token ids when it tokenized the prompt itself
    (chat templates, text prompts in a Serve replica); otherwise the core tokenizes ``prompt``.
    ``pooling_params`` make it a pooling (embedding) request; ``params`` are then unused."""

    request_id: str
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    priority: int = 0
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None
    # A VLM prompt's images, preprocessed by the front (``engine.multimodal.processor``);
    # prompt_token_ids are then the expanded ids.
    mm_features: list[MultiModalFeature] = []
    # Where the core's host also delivers this request's deltas (a Serve head actor hands them
    # to that ingress's token channel, ``cluster.serving.head_actor``); the core loop ignores it.
    sink: str | None = None


class ChoiceDelta(msgspec.Struct, array_like=True, frozen=True):
    """What is new for one of a request's n choices since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    # One entry per new token (token id -> Logprob, the sampled token first) when the request
    # asked for logprobs; aligned with ``token_ids``.
    logprobs: list[dict[int, Logprob]] | None
    # Set on the one delta in which this choice finishes.
    finish_reason: str | None
    stop_reason: int | str | None
    num_tokens: int  # this choice's tokens so far
    cumulative_logprob: float | None = None


class RequestDelta(msgspec.Struct, array_like=True):
    """One request's part of a step: the choices with something new. A pooling request has
    one delta, finished, with no choices: its ``embedding``, or None if it was aborted."""

    request_id: str
    choices: list[ChoiceDelta]
    finished: bool
    num_cached_tokens: int = 0
    # Sent once, with the request's first delta (the prompt is fully computed by then).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None
    # Set on a tally (a head's copy of a token-channel request's deltas for its front,
    # ``cluster.serving.head_actor``: the choices' finishes and counts, no tokens), which may
    # stand for several steps: each step's end (time.time()) and its tokens, oldest first.
    steps: list[tuple[float, int]] | None = None
    # Set on a finished request's last delta when its engine holds its blocks for another
    # engine's read (NixlConnector: RequestOutput.kv_transfer_params).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def num_new_tokens(self) -> int:
        """Tokens in this delta, over all its choices."""
        return sum(len(c.token_ids) for c in self.choices)


class StepOutputs(msgspec.Struct, array_like=True):
    """Everything one engine step produced, for all requests: the core -> front message."""

    deltas: list[RequestDelta]
    time: float  # wall-clock time (time.time()) at the end of the step


class AddResult(msgspec.Struct, array_like=True):
    prompt_token_ids: list[int]


def merge_deltas(deltas: list[RequestDelta]) -> RequestDelta:
    """Consecutive deltas of one request as one: per choice, texts, tokens and logprobs
    concatenated; the finish and running totals of the latest (linear in the tokens).
    ``steps`` is left out: a merger that knows the steps' times sets it."""
    parts: dict[int, list[ChoiceDelta]] = {}
    for delta in deltas:
        for choice in delta.choices:
            parts.setdefault(choice.index, []).append(choice)
    last = deltas[-1]
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None)
    return RequestDelta(
        request_id=last.request_id,
        choices=[_join(parts[i]) for i in sorted(parts)],
        finished=any(d.finished for d in deltas),
        num_cached_tokens=last.num_cached_tokens,
        prompt_logprobs=prompt_logprobs,
        kv_transfer_params=last.kv_transfer_params,
    )


def _join(parts: list[ChoiceDelta]) -> ChoiceDelta:
    if len(parts) == 1:
        return parts[0]
    logprobs = None
    if any(p.logprobs is not None for p in parts):
        logprobs = [entry for p in parts for entry in p.logprobs or ()]
    finish = next((p for p in reversed(parts) if p.finish_reason is not None), None)
    latest = parts[-1]
    return ChoiceDelta(
        index=latest.index,
        text="".join(p.text for p in parts),
        token_ids=[t for p in parts for t in p.token_ids],
        logprobs=logprobs,
        finish_reason=finish.finish_reason if finish is not None else None,
        stop_reason=finish.stop_reason if finish is not None else None,
        num_tokens=latest.num_tokens,
        cumulative_logprob=latest.cumulative_logprob,
    )


_STEP_ENCODER = msgspec.msgpack.Encoder()
_STEPS_DECODER = msgspec.msgpack.Decoder(list[StepOutputs])


def encode_steps(steps: list[StepOutputs]) -> bytes:
    return _STEP_ENCODER.encode(steps)


def decode_steps(data: bytes) -> list[StepOutputs]:
    return _STEPS_DECODER.decode(data)


class CoreLoad(msgspec.Struct, array_like=True):
    """One data-parallel engine core's load in a ``CoreStats`` snapshot."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of the core's blocks held by requests, in [0, 1]


class CoreStats(msgspec.Struct):
    """A snapshot taken on the core thread between steps."""

    num_running: int
    num_waiting: int
    kv_total_blocks: int
    kv_free_blocks: int
    kv_usage: float  # fraction of blocks held by requests, in [0, 1]
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_steps: int
    # MoE models: tokens routed to each expert since start, {sparse layer: [tokens per expert]}.
    moe_expert_tokens: dict[int, list[int]] = {}
    # Speculative decoding since start (engine.spec_decode.metrics): verifications, proposed
    # tokens, accepted tokens, and accepted tokens per proposal position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # data_parallel_size > 1: each engine core's load, in core order (empty for one core).
    cores: list[CoreLoad] = []
    # kv_transfer_config: prompt tokens looked up in the KV store after the device's hits, and
    # those loaded from it (vLLM's external prefix cache).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class CoreError(msgspec.Struct, array_like=True):
    """One error table for the head's replies: what kind, for the client, and where."""

    kind: Literal["invalid", "overloaded", "state", "failed", "dead"]
    message: str
    param: str | None = None
    retry_after_s: int = 1

    def exception(self) -> Exception:
        if self.kind == "invalid":
            return InvalidRequestError(self.message, self.param)
        if self.kind == "overloaded":
            return EngineOverloadedError(self.message, self.retry_after_s)
        if self.kind == "state":
            return EngineStateError(self.message)
        if self.kind == "failed":
            return RequestFailedError(self.message)
        return EngineDeadError(self.message)

    @classmethod
    def of(cls, exc: BaseException) -> CoreError:
        if isinstance(exc, InvalidRequestError):
            return cls("invalid", exc.reason, exc.param)
        if isinstance(exc, EngineOverloadedError):
            return cls("overloaded", str(exc), None, exc.retry_after_s)
        if isinstance(exc, EngineStateError):
            return cls("state", str(exc))
        if isinstance(exc, EngineDeadError):
            return cls("dead", str(exc) or type(exc).__name__)
        # Anything else failed this request alone; its traceback stays in the engine's log.
        return cls("failed", f"the engine could not take the request: {type(exc).__name__}")


class AddReply(msgspec.Struct, array_like=True):
    result: AddResult | None = None
    error: CoreError | None = None


# The engine's control calls a client may make between steps (``EngineCoreClient.control``).
CONTROLS = ("sleep", "wake_up", "is_sleeping", "reset_prefix_cache")


class ControlReply(msgspec.Struct, array_like=True):
    value: bool | None = None
    error: CoreError | None = None


__all__ = [
    "CONTROLS",
    "AddReply",
    "AddRequest",
    "AddResult",
    "ChoiceDelta",
    "ControlReply",
    "CoreError",
    "CoreStats",
    "RequestDelta",
    "StepOutputs",
    "decode_steps",
    "encode_steps",
    "merge_deltas",
]
