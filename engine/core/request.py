"""A request as the head tracks it: its tokens, how many are computed, and its status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.lora import LoRARequest
    from engine.multimodal.inputs import MultiModalFeature
    from engine.multimodal.mrope import MRopePositions


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # A parallel sample (n > 1) waiting for its group's first sample to compute the shared
    # prompt; it then forks from that sample's blocks (see ``Scheduler``).
    WAITING_FOR_PROMPT = "waiting_for_prompt"
    # Structured outputs: the request's grammar is still compiling; it joins the waiting
    # queue once it has compiled (``Scheduler.admit``).
    WAITING_FOR_FSM = "waiting_for_fsm"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recompute: blocks freed, back in the waiting queue
    SWAPPED = "swapped"  # swap: blocks moved to CPU swap space
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self in _FINISHED else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


class Request:
    """Token state of one request.

    Invariant: ``num_computed_tokens <= num_tokens``; the K/V of tokens
    ``[0, num_computed_tokens)`` live in the blocks of this request's block table.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        eos_token_id: int | None = None,
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        parent_request_id: str | None = None,
        index: int = 0,
        pooling_params: PoolingParams | None = None,
        skip_prefix_cache: bool = False,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeature] | None = None,
        mrope: MRopePositions | None = None,
    ) -> None:
        self.request_id = request_id
        # Parallel sampling: the user's request id and this sample's index among its n.
        self.parent_request_id = parent_request_id or request_id
        self.index = index
        # A pooling (embedding) request: it samples nothing and finishes once its prompt is
        # computed (its sampling_params are a placeholder).
        self.pooling_params = pooling_params
        # Every prompt position must be computed (mean pooling): no prefix-cache hits.
        self.skip_prefix_cache = skip_prefix_cache
        self.prompt_token_ids = list(prompt_token_ids)
        # A VLM prompt's images: their placeholder ranges, hashes and pixels (sent to the
        # workers once, with the request's first scheduled chunk).
        self.mm_features = mm_features or []
        # An M-RoPE model's 3-D prompt positions (engine.multimodal.mrope), sent with it.
        self.mrope = mrope
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        # The tokenizer's EOS, of ``eos_token_ids``: the one whose stop has no stop_reason
        # (vLLM makes generation_config's other EOS ids stop tokens; ``check_token_stop``).
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        # NixlConnector (engine.kv_transfer.nixl): the remote prefill this request reads its
        # prompt blocks from (taken at its first admission, never read again), and, on a
        # prefill engine, what its output hands the decode engine.
        self.remote_prefill: dict[str, Any] | None = (
            sampling_params.kv_transfer_params if index == 0 else None
        )
        self.kv_transfer_params: dict[str, Any] | None = None
        # 0: the base model. The scheduler caps the distinct ids of running requests.
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = (
            -1
        )  # set at the first schedule: prompt tokens found in the prefix cache
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # How many of all_token_ids the workers have been sent (the rest go as new_token_ids).
        self.num_tokens_sent = 0
        # After a preemption the workers' block table for this request is stale: the next step
        # sends the whole table again.
        self.needs_full_table = False
        # Chained prefix-cache hashes of this request's full blocks, grown as tokens are added.
        self.block_hashes: list[bytes] = []
        # Speculative decoding: tokens proposed to follow all_token_ids, verified by the next
        # step that schedules this request; the proposer's incremental state (see
        # engine.spec_decode).
        self.spec_token_ids: list[int] = []
        self.spec_state: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first ``num_output_tokens`` outputs: a verified run of speculative
        tokens that went past a stop (a stop string found by the detokenizer)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - drop :]
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens - 1)

    def sort_key(self, policy: str) -> tuple[float, ...]:
        """Smaller = served first. FCFS: arrival; priority: (priority value, arrival)."""
        if policy == "priority":
            return (self.priority, self.arrival_time)
        return (self.arrival_time,)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
