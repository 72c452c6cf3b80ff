"""Iteration-level (continuous) batching with chunked prefill and preemption.

Each request tracks ``num_computed_tokens``; a step gives each scheduled request some tokens
under a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. running requests first, in policy order (a decode token, or the next chunk of a prompt);
   when blocks run out (in any KV cache group: ``engine.core.block_manager``), the lowest-priority /
   latest-arrived running request is preempted —
   recompute (free its blocks, requeue it) or swap (move its blocks to CPU swap space);
2. then, if nothing was preempted, swapped requests come back (swap-in);
3. then, if nothing is swapped out, waiting requests are admitted, reusing prefix-cache hits.

A prompt longer than the remaining budget is chunked across steps, so decodes never starve;
with ``disable_chunked_mm_input`` (Gemma 3) a chunk never ends inside an image: it stops
before it, and a prefix-cache hit ending inside one backs off to before it. This module is a
CPU-only state machine: it never touches a model or a tensor. ``Scheduler``'s docstring has
the rules for parallel sampling (n > 1), LoRA slots, batches in flight (pipeline parallelism)
and pooling requests. A step's decision and its wire message are ``engine.core.scheduler_output``;
the waiting queue, ``engine.core.request_queue``.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterable

from engine.config_sections import SchedulerConfig
from engine.core.block_manager import BlockManager
from engine.core.block_pool import KVCacheBlock
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import WaitingQueue
from engine.core.scheduler_output import SchedulerOutput
from engine.kv_transfer.connector import KVConnectorScheduler
from engine.multimodal.inputs import stop_before_split_image, whole_image_prefix

logger = logging.getLogger("llm_cluster.scheduler")


class Scheduler:
    """The scheduler's state machine (queues, budgets, preemption, forks, batches in flight,
    lookahead slots for speculation): each decision reads all queues and budgets at once.

    Parallel sampling (n > 1): the engine adds the n samples of a request as n ``Request``s;
    sample 0 is scheduled like any request, samples 1..n-1 wait (``WAITING_FOR_PROMPT``, in no
    queue) until sample 0 has computed the whole prompt (P tokens). Then each forks: it shares
    sample 0's blocks holding tokens [0, P - 1) (ref counts + 1, see ``BlockManager.fork``),
    starts with P - 1 computed tokens and recomputes only the last prompt token, whose logits it
    samples its first token from (with its own seed). Its write into the shared, partially
    filled last block is a copy-on-write (``blocks_to_copy``). So the prompt is computed once,
    one token per extra sample is recomputed, and a group holds ceil(P / block_size) prompt
    blocks plus at most one copied block per sample. Admission reserves ``max_num_seqs`` room
    for the whole group; if sample 0 ends before the fork (abort, or a stop), the waiting
    samples fall back to the waiting queue.

    LoRA: the running requests use at most ``max_loras`` distinct adapters (the device slots),
    so every step's adapters are resident. A waiting (or swapped) request whose adapter would be
    one too many waits, and requests behind it of adapters already running (or of the base
    model) are admitted past it, keeping their queue order.

    Batches in flight (pipeline parallelism): the engine may send a step before the previous
    one returns (``pipeline_depth`` > 1, one batch per pipeline stage). A request in a batch not
    yet returned is "in flight" (``in_flight``: counted by ``schedule``, cleared by
    ``update_from_output``): it is not scheduled again (its next token is unknown) and never
    chosen as a preemption victim (its blocks are being written); a request short of blocks
    preempts among the others, itself included. Each batch takes at most
    ceil(live requests / ``pipeline_depth``) requests, so the live requests split into about
    ``pipeline_depth`` groups that take turns, one per stage, as vLLM's virtual engines did;
    with one batch at a time there is no such cap and nothing is counted. An abort frees a
    request's blocks at once even when it is in flight: every worker runs the batches in the
    order they were sent, so the batch in flight is done with those blocks before a later batch
    reuses them, and its returned tokens are dropped.

    Pooling (embedding) requests are scheduled like any prompt (chunked, mixed with decodes) and
    finish, freeing their blocks, in the step that computes the last prompt token; they sample
    nothing (the workers return their pooled vector instead).
    """

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, max_loras: int | None = None
    ) -> None:
        self.config = config
        # Distinct LoRA adapters allowed among running requests (None: LoRA is off).
        self.max_loras = max_loras
        self.block_manager = block_manager
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_req_ids: list[str] = []
        # Parallel samples waiting for the prompt, by the request id of the sample they fork from.
        self.pending_forks: dict[str, list[Request]] = {}
        # Requests whose grammar is still compiling (WAITING_FOR_FSM), outside every queue.
        self.awaiting_grammar: set[Request] = set()
        self.num_preemptions = 0
        self.num_swap_outs = 0
        # Batches the engine may have in flight at once, and the requests in them (a request
        # in flight is never scheduled again, so it is in one batch at most).
        self.pipeline_depth = 1
        # speculative_config method draft_model: slots reserved past a step's tokens, where the
        # draft writes the K/V of the k tokens it proposes after the step (set by the engine).
        self.num_lookahead_tokens = 0
        self.in_flight: set[str] = set()
        self._batch_cap = 0  # the most requests the batch being scheduled may take
        # kv_transfer_config: blocks loaded from and saved to the store (set by the engine).
        self.kv_transfer: KVConnectorScheduler | None = None

    # ---- request lifecycle --------------------------------------------------------------

    def add_request(
        self, request: Request, forks: Iterable[Request] = (), *, awaiting_grammar: bool = False
    ) -> None:
        """Enqueue ``request``; ``forks`` (its sibling samples) fork from it once its prompt is
        computed. ``awaiting_grammar``: it is held (``WAITING_FOR_FSM``, counted as queued) until
        ``admit``."""
        forks = list(forks)
        for r in [request, *forks]:
            held = self.kv_transfer is not None and self.kv_transfer.holds(r.request_id)
            if r.request_id in self.requests or held:
                raise ValueError(f"request_id: {r.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if awaiting_grammar:
            request.status = RequestStatus.WAITING_FOR_FSM
            self.awaiting_grammar.add(request)
        else:
            self.waiting.add(request)
        for fork in forks:
            fork.status = RequestStatus.WAITING_FOR_PROMPT
            self.requests[fork.request_id] = fork
        if forks:
            self.pending_forks[request.request_id] = forks

    def admit(self, request: Request) -> None:
        """A request held by ``add_request(awaiting_grammar=True)`` joins the waiting queue."""
        self.awaiting_grammar.remove(request)
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, or a stop string found by the detokenizer) and free their blocks."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(request)
            if request.status is RequestStatus.WAITING_FOR_PROMPT:
                self._remove_pending_fork(request)
            self.awaiting_grammar.discard(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def _remove_pending_fork(self, request: Request) -> None:
        for source_id, forks in list(self.pending_forks.items()):
            if request in forks:
                forks.remove(request)
                if not forks:
                    del self.pending_forks[source_id]

    def _free_request(self, request: Request) -> None:
        # Samples still waiting to fork from this one compute their own prompt instead.
        for fork in self.pending_forks.pop(request.request_id, []):
            fork.status = RequestStatus.WAITING
            self.waiting.add(fork)
        if request in self.running:
            self.running.remove(request)
        if request in self.swapped:
            self.swapped.remove(request)
        # NixlConnector: a prefill for remote decode keeps its blocks until they are read.
        if self.kv_transfer is None or not self.kv_transfer.hold(request):
            self.block_manager.free(request)
        self.block_manager.free_swapped(request)
        self.requests.pop(request.request_id, None)
        self._finished_req_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def waiting_load(self) -> tuple[int, int]:
        """What admission control bounds: the samples not running (waiting, preempted, swapped
        out, or waiting to fork) and the tokens the queued ones still have to compute."""
        queued = [*self.waiting, *self.swapped, *self.awaiting_grammar]
        forks = sum(len(f) for f in self.pending_forks.values())
        tokens = sum(r.num_tokens - r.num_computed_tokens for r in queued)
        return len(queued) + forks, tokens

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped) + len(self.awaiting_grammar)

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.kv_transfer is not None:
            self.kv_transfer.poll()
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        self._batch_cap = self._requests_per_batch()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_req_ids:
            budget = self._schedule_swapped(out, budget)
        if not out.preempted_req_ids and not self.swapped:
            self._schedule_waiting(out, budget)
        self._record_copies(out)
        if self.kv_transfer is not None:
            out.kv_saves = self.kv_transfer.take_saves()
        if self.pipeline_depth > 1:
            self.in_flight.update(out.num_scheduled_tokens)
        return out

    def _requests_per_batch(self) -> int:
        """At most ceil(live requests / pipeline_depth) per batch, so the requests split into
        one group per batch in flight; unbounded with one batch at a time."""
        if self.pipeline_depth <= 1:
            return sys.maxsize
        live = len(self.running) + len(self.waiting) + len(self.swapped)
        return max(1, math.ceil(live / self.pipeline_depth))

    def _batch_full(self, out: SchedulerOutput) -> bool:
        return len(out.num_scheduled_tokens) >= self._batch_cap

    def _record_copies(self, out: SchedulerOutput) -> None:
        """Hand this step's copy-on-write pairs to the workers. A copy replaced a block in the
        middle of its request's table, so a request the workers already know gets its whole
        table again. (A request preempted later in the step had its copies cancelled; the
        workers swap out before they copy, so a copy may write into a block swapped out in the
        same step.)"""
        for src, dst, rid in self.block_manager.take_copies():
            out.blocks_to_copy.append((src, dst))
            request = self.requests.get(rid)
            if request is not None and request in out.cached_reqs:
                out.resumed_req_ids.add(rid)
                out.new_block_ids[rid] = self.block_manager.get_block_ids(rid)

    def _tokens_to_compute(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        num_new = max(
            0, min(remaining, budget, self.config.max_model_len - request.num_computed_tokens)
        )
        return self._stop_before_split_image(request, request.num_computed_tokens, num_new)

    def _stop_before_split_image(self, request: Request, start: int, num_new: int) -> int:
        if not self.config.disable_chunked_mm_input:
            return num_new
        return stop_before_split_image(request.mm_features, start, num_new)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        if self.config.policy == "priority":
            self.running.sort(key=lambda r: r.sort_key("priority"))
        for request in list(self.running):
            if budget <= 0 or self._batch_full(out):
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop as someone's victim
            if request.request_id in self.in_flight:
                continue  # its next token is still being computed
            num_new = self._tokens_to_compute(request, budget)
            if num_new == 0:
                continue
            spec = self._spec_tokens(request, num_new, budget)
            # Lookahead slots: blocks for the proposals' K/V too (num_computed + 1 + k).
            end = request.num_computed_tokens + num_new + len(spec)
            new_blocks = self._allocate_or_preempt(
                request, num_new + len(spec) + self._lookahead(end), out
            )
            if new_blocks is None:
                continue
            if spec:
                out.spec_token_ids[request.request_id] = spec
            budget -= num_new + len(spec)
            self._record(out, request, num_new + len(spec), new_blocks)
        return budget

    def _spec_tokens(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The proposals a decoding request verifies this step, cut to the budget and to
        max_model_len. Only a pure decode step speculates (a request still prefilling, or
        recomputing after a preemption, computes its known tokens first)."""
        if not request.spec_token_ids or num_new != 1:
            return []
        if request.num_computed_tokens + 1 != request.num_tokens:
            return []
        room = min(budget - 1, self.config.max_model_len - request.num_tokens)
        return request.spec_token_ids[: max(0, room)]

    def _lookahead(self, end: int) -> int:
        """Draft lookahead slots after a step that ends at ``end`` tokens (none past
        max_model_len)."""
        return max(0, min(self.num_lookahead_tokens, self.config.max_model_len - end))

    def _allocate_or_preempt(
        self, request: Request, num_new: int, out: SchedulerOutput
    ) -> list[KVCacheBlock] | None:
        while True:
            new_blocks = self.block_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            # Never a request in a batch in flight (``request`` itself is not in one).
            candidates = [r for r in self.running if r.request_id not in self.in_flight]
            victim = max(candidates, key=lambda r: r.sort_key(self.config.policy))
            self._preempt(victim, out)
            if victim is request:
                return None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        if request.request_id in out.num_scheduled_tokens:
            # Scheduled earlier in this step: take it back out of the step.
            del out.num_scheduled_tokens[request.request_id]
            out.new_block_ids.pop(request.request_id, None)
            out.spec_token_ids.pop(request.request_id, None)
            # A sample forked this step is new to the workers; any other, cached.
            (out.cached_reqs if request in out.cached_reqs else out.new_reqs).remove(request)
        copied = self.block_manager.cancel_copies(request.request_id)
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_req_ids.append(request.request_id)
        request.needs_full_table = True
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(request):
            pairs = self.block_manager.swap_out(request)
            out.blocks_to_swap_out.extend((copied.get(gpu, gpu), cpu) for gpu, cpu in pairs)
            self.num_swap_outs += 1
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            return
        if self.config.preemption_mode == "swap":
            logger.warning("swap space full: preempting %s by recompute", request.request_id)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.add(request, front=True)

    def _running_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _lora_blocked(self, request: Request, active: set[int]) -> bool:
        """Whether admitting ``request`` would put one adapter too many in the running set."""
        return (
            self.max_loras is not None
            and request.lora_int_id != 0
            and request.lora_int_id not in active
            and len(active) >= self.max_loras
        )

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        self.swapped.sort(key=lambda r: r.sort_key(self.config.policy))
        active = self._running_loras()
        while (
            self.swapped
            and len(self.running) < self.config.max_num_seqs
            and not self._batch_full(out)
        ):
            request = self.swapped[0]
            if self._lora_blocked(request, active):
                break
            num_new = self._tokens_to_compute(request, budget)
            # Swap in only when the next chunk fits too, so a swapped-in request makes progress.
            end = request.num_computed_tokens + num_new
            fits = self.block_manager.can_swap_in(request, num_new + self._lookahead(end))
            if not fits or num_new == 0:
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(request))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora_int_id:
                active.add(request.lora_int_id)
            new_blocks = (
                self.block_manager.allocate_slots(request, num_new + self._lookahead(end)) or []
            )
            budget -= num_new
            self._record(out, request, num_new, new_blocks)
        return budget

    def _num_reserved_seqs(self) -> int:
        """Sequence slots promised to samples that will fork from an admitted request."""
        return sum(
            len(forks)
            for rid, forks in self.pending_forks.items()
            if self.requests[rid].status in (RequestStatus.RUNNING, RequestStatus.SWAPPED)
        )

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        reserved = self._num_reserved_seqs()
        active = self._running_loras()
        lora_blocked: list[Request] = []
        try:
            self._admit_waiting(out, budget, reserved, active, lora_blocked)
        finally:
            # Back in their places: FCFS puts them at the front in order; priority re-heaps.
            for request in reversed(lora_blocked):
                self.waiting.add(request, front=True)

    def _admit_waiting(
        self,
        out: SchedulerOutput,
        budget: int,
        reserved: int,
        active: set[int],
        lora_blocked: list[Request],
    ) -> None:
        while self.waiting and budget > 0 and not self._batch_full(out):
            request = self.waiting.peek()
            if self._lora_blocked(request, active):
                lora_blocked.append(self.waiting.pop())
                continue
            group = 1 + len(self.pending_forks.get(request.request_id, ()))
            if len(self.running) + reserved + group > self.config.max_num_seqs:
                break
            whole = self.config.disable_chunked_mm_input
            computed_blocks, num_cached = self.block_manager.get_computed_blocks(
                request, whole_images=whole
            )
            # Blocks after the device's hits that the KV store holds: loaded, not computed.
            stored = 0
            bs = self.block_manager.block_size
            if self.kv_transfer is not None:
                stored = self.kv_transfer.stored_blocks(request, num_cached)
                if whole and stored:  # they too stop before an image they would split
                    end = whole_image_prefix(request.mm_features, num_cached + stored * bs, bs)
                    stored = max(end - num_cached, 0) // bs
            num_computed = num_cached + stored * bs
            num_new = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = self._stop_before_split_image(request, num_computed, min(num_new, budget))
            if num_new == 0:
                break  # the next image does not fit this step's budget: a later step
            # A waiting request has num_computed_tokens == 0: its cache hits count via the blocks.
            new_blocks = self.block_manager.allocate_slots(
                request,
                num_computed - num_cached + num_new + self._lookahead(num_computed + num_new),
                computed_blocks,
            )
            if new_blocks is None:
                break
            self.waiting.pop()
            request.num_computed_tokens = num_computed
            if self.kv_transfer is not None:
                loads = self.kv_transfer.admit(request, num_cached, stored)
                if loads:
                    out.kv_loads[request.request_id] = loads
                    source = self.kv_transfer.load_source(request.request_id)
                    if source is not None:
                        out.kv_load_sources[request.request_id] = source
                    out.kv_load_first[request.request_id] = (
                        num_cached // self.block_manager.block_size
                    )
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
                self.block_manager.prefix_queries += request.num_tokens
                self.block_manager.prefix_hits += num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora_int_id:
                active.add(request.lora_int_id)
            reserved += group - 1
            budget -= num_new
            self._record(out, request, num_new, computed_blocks + new_blocks)

    def _record(
        self, out: SchedulerOutput, request: Request, num_new: int, new_blocks: list[KVCacheBlock]
    ) -> None:
        rid = request.request_id
        out.num_scheduled_tokens[rid] = num_new
        if request.num_tokens_sent == 0:
            out.new_reqs.append(request)
            out.new_block_ids[rid] = self.block_manager.get_block_ids(rid)
            return
        out.cached_reqs.append(request)
        if request.needs_full_table:
            request.needs_full_table = False
            out.resumed_req_ids.add(rid)
            out.new_block_ids[rid] = self.block_manager.get_block_ids(rid)
        else:
            out.new_block_ids[rid] = [b.block_id for b in new_blocks]

    # ---- after the forward pass ---------------------------------------------------------

    def void_failed_loads(self, out: SchedulerOutput, failures: dict[str, int]) -> None:
        """Requests of ``out`` whose stored blocks did not all load on some rank (``failures``:
        how many did, from the first): their work in that step is void, so it is not taken;
        each continues from its first block not loaded (``KVTransferScheduler.failed``)."""
        for rid, loaded in failures.items():
            num = out.num_scheduled_tokens.pop(rid, None)
            self.in_flight.discard(rid)
            request = self.requests.get(rid)
            if num is None or request is None or request.status is not RequestStatus.RUNNING:
                continue
            if self.kv_transfer is not None and rid in out.kv_loads:
                requested = len(out.kv_loads[rid])
                self.kv_transfer.failed(request, out.kv_load_first[rid], loaded, requested)

    def update_from_output(
        self, out: SchedulerOutput, req_ids: list[str], sampled_token_ids: list[list[int]]
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that hit a stop and
        pooling requests that computed their whole prompt.

        Returns the requests that got new tokens (finished ones included), then the pooling
        requests that finished.
        """
        pooled = []
        self.in_flight.difference_update(out.num_scheduled_tokens)
        for rid, num in out.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if self.kv_transfer is not None:
                self.kv_transfer.completed(request, request.num_computed_tokens,
                                           request.num_computed_tokens + num)  # fmt: skip
            request.num_computed_tokens += num
            if rid in out.spec_token_ids:
                # Cached once the accepted tokens are appended (below): only verified ones.
                continue
            self.block_manager.cache_blocks(request)
            if request.is_pooling and request.num_computed_tokens >= request.num_prompt_tokens:
                request.status = RequestStatus.FINISHED_STOPPED
                self._free_request(request)
                pooled.append(request)
            elif (
                rid in self.pending_forks
                and request.num_computed_tokens >= request.num_prompt_tokens
            ):
                self._fork(request, self.pending_forks.pop(rid))
        updated = []
        for rid, token_ids in zip(req_ids, sampled_token_ids):
            request = self.requests.get(rid)
            if request is None or request.is_finished or not token_ids:
                continue
            spec = out.spec_token_ids.get(rid)
            if spec is not None:
                # The K/V of rejected proposals was written but is not the request's: only
                # the last token and the accepted proposals (len(token_ids) - 1) count.
                request.num_computed_tokens -= len(spec) + 1 - len(token_ids)
            status = self._append_tokens(request, token_ids)
            if spec is not None:
                self.block_manager.cache_blocks(request)
            if status is not None:
                request.status = status
                self._free_request(request)
            updated.append(request)
        return updated + pooled

    def _append_tokens(self, request: Request, token_ids: list[int]) -> RequestStatus | None:
        """Append one step's tokens, stopping at the first that ends the request (EOS, a stop
        token, max_tokens): the tokens after it are dropped from ``token_ids`` too (in place, so
        the step's output reports the tokens kept)."""
        if len(token_ids) == 1:
            request.append_output_token_ids(token_ids)
            return check_token_stop(request, self.config.max_model_len)
        for i, token in enumerate(token_ids):
            request.append_output_token_ids([token])
            status = check_token_stop(request, self.config.max_model_len)
            if status is not None:
                del token_ids[i + 1 :]
                request.num_computed_tokens = min(
                    request.num_computed_tokens, request.num_tokens - 1
                )
                return status
        return None

    def _fork(self, source: Request, forks: list[Request]) -> None:
        """``source`` has just computed its whole prompt: its sibling samples share the blocks of
        all prompt tokens but the last, which each recomputes to sample its own first token."""
        num_shared = source.num_prompt_tokens - 1
        for fork in forks:
            self.block_manager.fork(source, fork, num_shared)
            fork.num_computed_tokens = num_shared
            fork.status = RequestStatus.RUNNING
            self.running.append(fork)


def check_token_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Stop conditions that need no text: EOS, stop_token_ids (both only once min_tokens are
    generated), max_tokens, max_model_len."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            own = request.eos_token_id is None or last == request.eos_token_id
            request.stop_reason = None if own else last
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
