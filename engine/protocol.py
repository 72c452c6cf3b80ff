"""The head -> worker data contract: one ``ExecuteModelRequest`` per step, one reply.

New requests travel in full once; running ones as deltas (tokens sampled since they were last
sent, newly allocated blocks). Workers keep per-request state between steps (the persistent
batch) and drop it when the request id appears in ``finished_req_ids``. Messages are msgspec
structs with an explicit msgpack codec: nothing here is ever pickled.
"""

from __future__ import annotations

import msgspec

from engine.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, kw_only=True):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, kw_only=True):
    req_id: str
    # Tokens the head appended (sampled) since this request was last sent.
    new_token_ids: list[int]
    # Appended to the block table; when resumed_from_preemption they replace it instead.
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

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    # Requests that reached the end of their known tokens this step, in batch order, and the
    # token(s) sampled for each. A request whose prefill chunk ended mid-prompt is absent.
    req_ids: list[str]
    sampled_token_ids: list[list[int]]


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ExecuteModelRequest)
_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)


def encode(message: ExecuteModelRequest | ModelRunnerOutput) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> ExecuteModelRequest:
    return _request_decoder.decode(data)


def decode_output(data: bytes) -> ModelRunnerOutput:
    return _output_decoder.decode(data)
