"""What one scheduler step decided (``SchedulerOutput``: the requests it runs and how many
tokens each, the blocks each gained, swaps, copies, finished and preempted ids, speculative
proposals and KV transfers), and the wire message the workers get for it
(``make_execute_model_request``: new requests in full, running ones as deltas).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.request import Request
from engine.worker.step_messages import CachedRequestData, ExecuteModelRequest, NewRequestData


@dataclass
class SchedulerOutput:
    """What one step computes; ``make_execute_model_request`` turns it into the wire message."""

    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    resumed_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the proposals each request verifies this step (counted in its
    # num_scheduled_tokens).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # kv_transfer_config: stored blocks each admitted request loads, (hash, block id) from its
    # block ``kv_load_first[rid]`` on (NixlConnector: (remote block id, block id)); prompt
    # blocks earlier steps completed, to store.
    kv_loads: dict[str, list[tuple[bytes | int, int]]] = field(default_factory=dict)
    kv_load_first: dict[str, int] = field(default_factory=dict)
    kv_saves: list[tuple[bytes, int]] = field(default_factory=list)
    # NixlConnector: where each request's kv_loads are read from (the prefill's agents).
    kv_load_sources: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


def make_execute_model_request(out: SchedulerOutput) -> ExecuteModelRequest:
    """The wire message for one step: new requests in full, running ones as deltas."""
    new = []
    for request in out.new_reqs:
        new.append(
            NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=list(request.all_token_ids),
                sampling_params=request.sampling_params,
                block_ids=out.new_block_ids[request.request_id],
                num_computed_tokens=request.num_computed_tokens,
                num_prompt_tokens=request.num_prompt_tokens,
                eos_token_ids=sorted(request.eos_token_ids),
                pooling_params=request.pooling_params,
                lora_int_id=request.lora_int_id,
                mm_features=request.mm_features,
                mrope=request.mrope,
            )
        )
        request.num_tokens_sent = request.num_tokens
    cached = []
    for request in out.cached_reqs:
        rid = request.request_id
        cached.append(
            CachedRequestData(
                req_id=rid,
                new_token_ids=request.all_token_ids[request.num_tokens_sent :],
                new_block_ids=out.new_block_ids[rid],
                num_computed_tokens=request.num_computed_tokens,
                resumed_from_preemption=rid in out.resumed_req_ids,
            )
        )
        request.num_tokens_sent = request.num_tokens
    return ExecuteModelRequest(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict(out.num_scheduled_tokens),
        total_num_scheduled_tokens=out.total_num_scheduled_tokens,
        finished_req_ids=list(out.finished_req_ids),
        blocks_to_swap_in=out.blocks_to_swap_in,
        blocks_to_swap_out=out.blocks_to_swap_out,
        blocks_to_copy=out.blocks_to_copy,
        scheduled_spec_decode_tokens=dict(out.spec_token_ids),
        kv_saves=out.kv_saves,
        kv_loads=out.kv_loads,
        kv_load_sources=out.kv_load_sources,
    )
