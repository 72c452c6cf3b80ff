"""The head -> worker data contract: one ``ExecuteModelRequest`` per step, one reply.

New requests travel in full once; running ones as deltas (tokens sampled since they were last
sent, newly allocated blocks). Workers keep per-request state between steps (the persistent
batch) and drop it when the request id appears in ``finished_req_ids``. Messages are msgspec
structs with an explicit msgpack codec: nothing here is ever pickled.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from engine.multimodal.inputs import MultiModalFeature
from engine.multimodal.mrope import MRopePositions
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


class LoRASlotSpec(msgspec.Struct, kw_only=True, frozen=True):
    """The adapter a LoRA slot now holds: workers read it from ``lora_path`` (each its shard)."""

    lora_int_id: int
    lora_path: str


class NewRequestData(msgspec.Struct, kw_only=True):
    req_id: str
    # All known tokens: the prompt, then (after a recompute) tokens generated so far.
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # How many of prompt_token_ids are the prompt (-1: all); penalties count the rest as output.
    num_prompt_tokens: int = -1
    # EOS ids that min_tokens masks (the head knows them from the generation config).
    eos_token_ids: list[int] = []
    # Set for a pooling (embedding) request: it samples nothing; once its prompt is computed
    # the driver returns its pooled vector in ``ModelRunnerOutput.pooled``.
    pooling_params: PoolingParams | None = None
    # The request's LoRA adapter (0: the base model); its slot is in the workers' slot table.
    lora_int_id: int = 0
    # A VLM prompt's images (placeholder ranges, hashes, pixels): sent this once; the workers
    # encode each when a chunk first reaches its placeholders and keep the output.
    mm_features: list[MultiModalFeature] = []
    # An M-RoPE model's (Qwen2.5-VL's) 3-D prompt positions; None: the text positions.
    mrope: MRopePositions | None = None


class CachedRequestData(msgspec.Struct, kw_only=True):
    req_id: str
    # Tokens the head appended (sampled) since this request was last sent.
    new_token_ids: list[int]
    # Appended to the block table; when resumed_from_preemption they replace it instead (also
    # sent that way after a copy-on-write replaced a block in the middle of the table).
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed_from_preemption: bool = False


class ExecuteModelRequest(msgspec.Struct, kw_only=True):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> number of tokens to compute this step (1 for a decode, a chunk for a prefill).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]
    # (src, dst) block pairs, applied before the forward pass: swap-in (cpu -> device),
    # swap-out (device -> cpu) and copy (device -> device, copy-on-write).
    blocks_to_swap_in: list[tuple[int, int]] = []
    blocks_to_swap_out: list[tuple[int, int]] = []
    blocks_to_copy: list[tuple[int, int]] = []
    # Structured outputs: the constrained requests that sample this step, and their next-token
    # bitmask, row i for structured_output_req_ids[i]: ceil(vocab_size / 32) little-endian
    # int32 words, bit j of word w set iff token 32w + j is allowed (see
    # engine.core.structured_output). Only the driver (the sampling rank) applies it.
    structured_output_req_ids: list[str] = []
    grammar_bitmask: bytes = b""
    # Speculative decoding: req_id -> the proposed tokens this step verifies after the
    # request's last token (its num_scheduled_tokens counts them: 1 + len(proposals)). They are
    # not the request's tokens: the reply's sampled_token_ids carry what was accepted.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # LoRA slots whose adapter changes before this step's forward pass: slot -> new adapter.
    # Every adapter of this step's requests is resident once they are applied.
    lora_slots: dict[int, LoRASlotSpec] = {}
    # kv_transfer_config (engine.kv_transfer): full prompt blocks an earlier step computed, to
    # store as (block hash, block id), saved before anything of this step writes the cache;
    # and per request, stored blocks to load as (block hash, block id) in table order, loaded
    # before the forward pass (the request's num_computed_tokens counts them).
    # NixlConnector: the blocks to read are (remote block id, block id), from the agents that
    # kv_load_sources[rid] names (engine.kv_transfer.nixl_worker).
    kv_saves: list[tuple[bytes, int]] = []
    kv_loads: dict[str, list[tuple[bytes | int, int]]] = {}
    kv_load_sources: dict[str, dict[str, Any]] = {}

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class LogprobsLists(msgspec.Struct, array_like=True):
    """Log-probabilities of some positions, one row each: column 0 is the chosen token (sampled,
    or the actual next prompt token), columns 1.. the top-k; ``ranks`` is the chosen token's
    1-based rank in the raw distribution."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Prompt logprobs computed by one prefill chunk: row i is prompt token ``start + i``."""

    start: int
    lists: LogprobsLists


class ModelRunnerOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    # Requests that reached the end of their known tokens this step, in batch order, and the
    # token(s) sampled for each. A request whose prefill chunk ended mid-prompt is absent.
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Aligned with req_ids when any request asked for logprobs (None for those that did not).
    logprobs: list[LogprobsLists | None] | None = None
    # req_id -> prompt logprobs of this step's chunk, for requests that asked.
    prompt_logprobs: dict[str, PromptLogprobs] = {}
    # req_id -> pooled vector (float32 values) of each pooling request whose prompt this step
    # finished computing; such a request appears nowhere else in this output.
    pooled: dict[str, list[float]] = {}
    # lora_int_id -> why this rank could not load the adapter into its slot this step (its
    # files were removed or changed after the head checked them). The slot is left empty; the
    # head ends that adapter's requests and checks the adapter again before its next use.
    # Any rank may report it: non-driver ranks then return an output holding only this.
    lora_load_errors: dict[int, str] = {}
    # speculative_config method draft_model: req_id -> the draft's proposals for the request's
    # next step (made on the driver after this step's tokens; the head trims and stores them).
    draft_token_ids: dict[str, list[int]] = {}
    # kv_loads this rank could not complete (a block's file gone or the wrong size): req_id ->
    # how many of its blocks, from the first, it loaded. This step's work for the request is
    # void (the head recomputes from there). Any rank may report it, like lora_load_errors.
    kv_load_failures: dict[str, int] = {}

    def drop_requests(self, req_ids: Iterable[str]) -> None:
        """Remove everything this output holds for ``req_ids`` (their step is void)."""
        gone = set(req_ids)
        keep = [i for i, rid in enumerate(self.req_ids) if rid not in gone]
        self.req_ids = [self.req_ids[i] for i in keep]
        self.sampled_token_ids = [self.sampled_token_ids[i] for i in keep]
        if self.logprobs is not None:
            self.logprobs = [self.logprobs[i] for i in keep]
        for rid in gone:
            self.pooled.pop(rid, None)
            self.prompt_logprobs.pop(rid, None)
            self.draft_token_ids.pop(rid, None)


class DataParallelStep(msgspec.Struct, kw_only=True):
    """One step of every data-parallel engine core, sent to all their workers at once: DP rank
    d's workers run ``requests[d]`` (an empty one when that core has nothing scheduled)."""

    requests: list[ExecuteModelRequest]


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ExecuteModelRequest)
_dp_step_decoder = msgspec.msgpack.Decoder(DataParallelStep)
_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)


def encode(message: ExecuteModelRequest | DataParallelStep | ModelRunnerOutput) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes, dp_rank: int | None = None) -> ExecuteModelRequest:
    """The step message; with ``dp_rank``, data-parallel rank ``dp_rank``'s request out of a
    ``DataParallelStep``."""
    if dp_rank is None:
        return _request_decoder.decode(data)
    return _dp_step_decoder.decode(data).requests[dp_rank]


def empty_request(finished_req_ids: list[str] | None = None) -> ExecuteModelRequest:
    """A step that schedules nothing (a data-parallel core without work still steps)."""
    return ExecuteModelRequest(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        finished_req_ids=finished_req_ids or [],
    )


def decode_output(data: bytes) -> ModelRunnerOutput:
    return _output_decoder.decode(data)
