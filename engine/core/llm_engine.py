"""``LLMEngine``: the head's synchronous core — tokenize and validate, schedule, run a step on
the executor, update requests, detokenize, produce ``RequestOutput``s.

A user request with ``n`` samples becomes n scheduler ``Request``s gathered back into one
``RequestOutput``; a pooling request is one ``Request`` that samples nothing (``LLMEngine``
says how both map). Beam search runs outside the engine core, on top of it
(``engine.client.beam_search``).

With batches in flight (pipelined PP, ``Executor.max_concurrent_batches`` > 1) a step sends
batches until that many are out, then takes the oldest one's output (see ``engine.core.scheduler``).

Its parts, each in its own module: checking and tokenizing a request before it is admitted
(``engine.core.input_processor``); the per-request output state and the outputs built from it
(``engine.core.output_processor``); what a step adds for structured outputs and speculative
decoding (``engine.core.guided_steps``); the KV cache groups' pools
(``engine.core.kv_cache_groups``); LoRA adapters' checks and device slots
(``engine.core.lora_control``); sleep mode (``engine.core.sleep_control``); counters and
integrity checks (``engine.core.engine_stats``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager, KVCacheStats
from engine.core.engine_stats import (
    EngineCounters,
    check_scheduler_integrity,
    engine_counters,
    scheduler_state_sizes,
)
from engine.core.guided_steps import (
    PendingGrammars,
    add_grammar_bitmask,
    advance_grammar,
    attach_grammars,
    observe_spec_decode,
    propose,
)
from engine.core.input_processor import (
    InputProcessor,
    PromptType,
    eos_token_ids,
    load_tokenizer,
    sample_params,
)
from engine.core.kv_cache_groups import config_layout, describe_layout, request_block_capacity
from engine.core.lora_control import LoRAControl
from engine.core.output_processor import (
    LogprobTexts,
    PoolingState,
    RequestGroup,
    SampleState,
    decode_logprob_tokens,
    make_request_output,
    new_sample_state,
    pooling_output,
    record_prompt_logprobs,
    take_tokens,
)
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import check_priority, check_waiting_caps
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput, make_execute_model_request
from engine.core.sleep_control import SleepControl
from engine.core.structured_output import StructuredOutputManager
from engine.errors import EngineDeadError, InvalidRequestError
from engine.kv_transfer.connector import make_kv_scheduler
from engine.lora import LoRARequest
from engine.outputs import PoolingRequestOutput, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.spec_decode.metrics import SpecDecodeStats
from engine.spec_decode.ngram import NgramProposer
from engine.timing import StepTimer
from engine.worker.executor import Executor, StepFuture, get_executor_class
from engine.worker.step_messages import (
    ExecuteModelRequest,
    LogprobsLists,
    ModelRunnerOutput,
)

logger = logging.getLogger("llm_cluster.engine")

EngineOutput = RequestOutput | PoolingRequestOutput

# The sampling_params every Request carries; a pooling request never samples.
_POOLING_PLACEHOLDER = SamplingParams(temperature=0.0, max_tokens=1)
# NixlConnector: how often an otherwise idle engine looks for the notifications that release
# blocks held for a decode engine's read.
TRANSFER_POLL_S = 0.005


def _max_step_tokens(config: EngineConfig) -> int:
    """The most KV slots one request takes in a step: a whole prefill chunk (the token
    budget, at most max_model_len), plus a draft model's lookahead slots."""
    spec = config.speculative.speculative_config
    lookahead = (
        spec.num_speculative_tokens if spec is not None and spec.method == "draft_model" else 0
    )
    chunk = min(config.scheduler.max_num_batched_tokens, config.max_model_len)
    return chunk + lookahead


class LLMEngine(SleepControl, LoRAControl):
    """The head's per-step cycle: admit, schedule, execute, update, detokenize.

    A user request with ``n`` samples becomes n scheduler ``Request``s: sample 0 keeps the request
    id, sample i > 0 is ``"{i}_{request_id}"``; samples 1.. fork from sample 0's prompt blocks (see
    ``engine.core.scheduler``) and draw from their own seed stream (``seed + i``). The engine
    gathers them back into one ``RequestOutput`` with n ``CompletionOutput``s ordered by index,
    finished when all are. Aborting the request aborts every sample.

    A request added with ``PoolingParams`` instead of ``SamplingParams`` is a pooling (embedding)
    request: one scheduler ``Request`` that samples nothing; the step that computes its last prompt
    token returns its ``PoolingRequestOutput`` (the vector the workers pooled) and ends it.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor_class: Callable[[EngineConfig], Executor] | None = None,
    ) -> None:
        """``executor_class``: what builds the executor from the config (default: the class
        ``distributed_executor_backend`` names; a ``functools.partial`` of one may bind more,
        as the head actor binds its start-up observer)."""
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.eos_token_ids = eos_token_ids(config.model.model_path, self.tokenizer)
        self.executor = (executor_class or get_executor_class(config))(config)
        num_blocks, num_cpu_blocks = self.executor.determine_num_available_blocks()
        if config.scheduler.preemption_mode != "swap":
            num_cpu_blocks = 0
        group_bytes = self.executor.collective_rpc("kv_group_block_bytes")
        layout = config_layout(
            config,
            num_blocks,
            num_cpu_blocks,
            group_bytes,
            batches_in_flight=self.executor.max_concurrent_batches,
        )
        self.executor.initialize_cache(list(layout.num_blocks), list(layout.num_cpu_blocks))
        self.block_manager = BlockManager(
            layout,
            config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
        )
        self.inputs = InputProcessor(
            config,
            self.tokenizer,
            request_block_capacity(
                layout, config.cache.block_size, config.max_model_len, _max_step_tokens(config)
            ),
        )
        self._init_lora()
        lora = config.lora
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_manager,
            max_loras=lora.max_loras if lora.enable_lora else None,
        )
        if config.kv_transfer.kv_transfer_config is not None:
            kv = make_kv_scheduler(config, self.block_manager)
            kv.register_workers(
                [m for m in self.executor.collective_rpc("kv_transfer_metadata") if m]
            )
            self.scheduler.kv_transfer = kv
        self.structured_output = StructuredOutputManager(
            self.tokenizer, config.model.vocab_size, self.eos_token_ids
        )
        self._groups: dict[str, RequestGroup] = {}
        # Scheduler request id of every live sample -> (its group, its index).
        self._samples: dict[str, tuple[RequestGroup, int]] = {}
        self._pooling: dict[str, PoolingState] = {}
        self._compiling = PendingGrammars()
        # Batches sent and not yet taken, oldest first (more than one only when pipelined).
        self._pipeline_depth = self.executor.max_concurrent_batches
        self.scheduler.pipeline_depth = self._pipeline_depth
        self._batches: deque[tuple[SchedulerOutput, StepFuture]] = deque()
        self.step_timer = StepTimer()
        spec = config.speculative.speculative_config
        self.proposer = NgramProposer(spec, config.max_model_len) if spec is not None else None
        if spec is not None and spec.method == "draft_model":
            # The workers' draft proposes; the proposer only trims its tokens to the room left.
            self.scheduler.num_lookahead_tokens = spec.num_speculative_tokens
        self.spec_decode_stats = SpecDecodeStats()
        for line in describe_layout(
            layout, group_bytes, config.cache.block_size, config.max_model_len
        ):
            logger.info(line)

    @classmethod
    def from_engine_args(cls, **engine_args: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**engine_args))

    # ---- requests -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validate and enqueue; raises ``InvalidRequestError`` (naming the field) and enqueues
        nothing if the request is invalid. Raises ``EngineOverloadedError`` when the waiting
        queue is full and ``EngineDeadError`` once the workers are dead. ``PoolingParams``
        make it a pooling (embedding) request (vLLM's ``add_request`` takes either).
        ``lora_request`` runs it under that LoRA adapter, read and checked here (a bad
        adapter is an ``InvalidRequestError`` naming the problem). ``EngineSleepingError``
        while the engine sleeps."""
        self._check_alive()
        self._check_awake()
        check_priority(priority)
        params = params or SamplingParams()
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise InvalidRequestError(
                "must be a SamplingParams or a PoolingParams", param="sampling_params"
            )
        self.inputs.check_cache_salt(cache_salt)
        self._check_lora(lora_request)
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(
                request_id, prompt, params, arrival_time, priority, cache_salt, lora_request
            )
        self.inputs.check_generates()
        text, token_ids = self.inputs.tokenize(prompt)
        token_ids, mm_features = self.inputs.process_multimodal(prompt, token_ids)
        mrope = self.inputs.mrope_positions(token_ids, mm_features)
        max_tokens = self.inputs.check_lengths(token_ids, params)
        params = self.inputs.check_sampling(params, max_tokens)
        compiled = None
        if params.structured_outputs is not None:
            # Checked and parsed now, so that a bad spec is a 400 here; compiled meanwhile.
            compiled = self.structured_output.prepare(
                params.structured_outputs, params.skip_special_tokens
            )
        check_waiting_caps(
            self.config.scheduler, self.scheduler.waiting_load, len(token_ids), params.n
        )
        sample_ids = [request_id] + [f"{i}_{request_id}" for i in range(1, params.n)]
        self._check_unused(request_id, sample_ids)
        arrival_time = arrival_time or time.monotonic()
        samples = [
            Request(
                rid,
                token_ids,
                sample_params(params, i),
                eos_token_ids=self.eos_token_ids,
                eos_token_id=self.tokenizer.eos_token_id,
                max_tokens=max_tokens,
                arrival_time=arrival_time,
                priority=priority,
                cache_salt=cache_salt,
                parent_request_id=request_id,
                index=i,
                lora_request=lora_request,
                mm_features=mm_features,
                mrope=mrope,
            )
            for i, rid in enumerate(sample_ids)
        ]
        group = RequestGroup(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            samples=[new_sample_state(r, self.tokenizer) for r in samples],
            prompt_logprobs=[None] * len(token_ids) if params.prompt_logprobs is not None else None,
        )
        awaiting = compiled is not None and not (
            compiled.done() and attach_grammars(group, compiled, self.structured_output)
        )
        self.scheduler.add_request(samples[0], forks=samples[1:], awaiting_grammar=awaiting)
        if awaiting:
            self._compiling.hold(request_id, compiled)
        self._groups[request_id] = group
        for i, rid in enumerate(sample_ids):
            self._samples[rid] = (group, i)
        return samples[0]

    def admit_compiled(self) -> list[EngineOutput]:
        """Requests whose grammar has compiled join the queue; those whose compile failed end
        ("abort", the reason logged). Returns the ended requests' outputs."""
        failed = []
        for request_id, future in self._compiling.take_done():
            group = self._groups[request_id]
            if attach_grammars(group, future, self.structured_output):
                self.scheduler.admit(group.samples[0].request)
            else:
                logger.error("%s: the grammar did not compile: %s", request_id, future.exception())
                failed.append(request_id)
        return self.abort_request(failed) if failed else []

    def _add_pooling_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None,
        priority: int,
        cache_salt: str | None,
        lora_request: LoRARequest | None,
    ) -> Request:
        params = self.inputs.check_pooling(params)
        text, token_ids = self.inputs.tokenize(prompt)
        self.inputs.process_multimodal(prompt, token_ids)  # (a VLM never pools: images refused)
        self.inputs.check_pooling_length(token_ids)
        check_waiting_caps(self.config.scheduler, self.scheduler.waiting_load, len(token_ids), 1)
        self._check_unused(request_id, [request_id])
        request = Request(
            request_id,
            token_ids,
            _POOLING_PLACEHOLDER,
            max_tokens=0,
            arrival_time=arrival_time or time.monotonic(),
            priority=priority,
            cache_salt=cache_salt,
            pooling_params=params,
            # A cached prefix is never computed, so its positions would be missing from a mean.
            skip_prefix_cache=self.config.pooler.pooling_type == "mean",
            lora_request=lora_request,
        )
        self.scheduler.add_request(request)
        self._pooling[request_id] = PoolingState(request, text)
        return request

    def _check_unused(self, request_id: str, scheduler_ids: list[str]) -> None:
        # An aborted request's batch in flight (pipelined PP) would give a new one its tokens.
        in_flight = any(r in self.scheduler.in_flight for r in scheduler_ids)
        used = request_id in self._groups or request_id in self._pooling
        if in_flight or used or any(r in self.scheduler.requests for r in scheduler_ids):
            why = " (an aborted request of that id is still in a batch being computed)"
            raise InvalidRequestError(
                f"{request_id!r} is already in use{why if in_flight else ''}", param="request_id"
            )

    def abort_request(self, request_id: str | Iterable[str]) -> list[EngineOutput]:
        """Abort live requests — every one of their samples; unknown or finished ids are
        ignored — and free their blocks now; returns the aborted requests' final outputs
        (finish_reason "abort" on the samples that were still running; a pooling request's
        output has no vector)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outputs: list[EngineOutput] = []
        for rid in ids:
            pooling = self._pooling.pop(rid, None)
            if pooling is not None:
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                outputs.append(pooling_output(pooling, None))
                continue
            group = self._groups.get(rid)
            if group is None:
                continue
            sample_ids = [s.request.request_id for s in group.samples]
            self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)
            final = self.make_output(group)
            if final is not None:  # always: the group has finished
                outputs.append(final)
            self._forget(group)
        if outputs and not self.scheduler.has_unfinished_requests():
            # Nothing will step again soon: the workers drop the aborted requests' state now.
            self._flush_finished()
        return outputs

    def _forget(self, group: RequestGroup) -> None:
        self._groups.pop(group.request_id, None)
        self._compiling.forget(group.request_id)
        for sample in group.samples:
            self._samples.pop(sample.request.request_id, None)

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Schedule, execute one step on the workers, and return outputs of updated requests.
        Raises ``EngineDeadError`` (failing every in-flight request) if a worker died.

        With batches in flight (a pipelined executor), one call sends new batches until
        ``max_concurrent_batches`` are out or nothing more can be scheduled, then takes the
        oldest batch's output: the outputs of one batch per call, in the order sent."""
        self._check_alive()
        if self._pipeline_depth > 1:
            return self._step_pipelined()
        self.step_timer.start()
        ended = self.admit_compiled()
        scheduled = self.schedule_batch()
        if scheduled is None:
            self.wait_when_idle()
            return ended
        sched, message = scheduled
        output = self.executor.execute_model(message)
        self.step_timer.lap("execute")
        return ended + self.finish_batch(sched, output)

    def wait_when_idle(self) -> None:
        """After a step with nothing to send: wait a little for what the requests wait on."""
        self._wait_for_transfers()
        if not self.scheduler.waiting and not self.scheduler.running:
            self._compiling.wait()  # nothing to run but grammars compiling

    def _wait_for_transfers(self) -> None:
        """Nothing to run but blocks held for a decode engine's read (NixlConnector): wait a
        little before the next poll rather than spin."""
        kv = self.scheduler.kv_transfer
        if kv is not None and kv.has_pending and not self.scheduler.has_unfinished_requests():
            time.sleep(TRANSFER_POLL_S)

    def _step_pipelined(self) -> list[EngineOutput]:
        clock = self.step_timer
        clock.start()
        ended = self.admit_compiled()
        while len(self._batches) < self._pipeline_depth:
            scheduled = self.schedule_batch()
            if scheduled is None:
                break
            sched, message = scheduled
            self._batches.append((sched, self.executor.execute_model_async(message)))
            if sched.total_num_scheduled_tokens == 0:
                break  # only finished ids to pass on: nothing else is schedulable
        if not self._batches:
            self.wait_when_idle()
            return ended
        sched, future = self._batches.popleft()
        try:
            output = future.result()
        except EngineDeadError:
            self._batches.clear()
            raise
        clock.lap("execute")
        return ended + self.finish_batch(sched, output)

    def schedule_batch(self) -> tuple[SchedulerOutput, ExecuteModelRequest] | None:
        """The next batch and its wire message; None when there is nothing to send. With
        ``finish_batch``, the two halves of ``step`` around the executor's call (a
        data-parallel engine sends every core's batch in one call)."""
        sched = self.scheduler.schedule()
        if not (sched.total_num_scheduled_tokens or sched.finished_req_ids or sched.kv_saves):
            return None
        message = make_execute_model_request(sched)
        add_grammar_bitmask(sched, message, self._sample_of, self.structured_output)
        self._assign_lora_slots(sched, message)
        self.step_timer.lap("schedule")
        return sched, message

    def finish_batch(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> list[EngineOutput]:
        """Take one batch's output: update the requests, detokenize, build their outputs."""
        clock = self.step_timer
        failed = self._fail_lora_loads(output.lora_load_errors)
        if output.kv_load_failures:
            # Stored KV blocks that did not all load (kv_transfer_config): what the step
            # computed for those requests is void; they continue from the first block not loaded.
            self.scheduler.void_failed_loads(sched, output.kv_load_failures)
            output.drop_requests(output.kv_load_failures)
        texts = decode_logprob_tokens(self.tokenizer, output)
        record_prompt_logprobs(self._samples, output.prompt_logprobs, texts)
        observe_spec_decode(self.spec_decode_stats, sched, output)
        updated = self.scheduler.update_from_output(sched, output.req_ids, output.sampled_token_ids)
        pooled = [r for r in updated if r.is_pooling]
        updated = [r for r in updated if not r.is_pooling]
        clock.lap("update")
        logprobs = dict(zip(output.req_ids, output.logprobs or ()))
        groups: dict[str, RequestGroup] = {}
        for request, num_new in self._new_tokens(updated, output):
            group, index = self._samples[request.request_id]
            sample = group.samples[index]
            advance_grammar(sample, num_new, self.scheduler)
            self._process(sample, num_new, logprobs.get(request.request_id), texts)
            if request.is_finished:
                sample.grammar = None
            else:
                propose(self.proposer, sample, output.draft_token_ids)
            groups[group.request_id] = group
        outputs: list[EngineOutput] = failed
        for group in groups.values():
            output_now = self.make_output(group)
            if output_now is not None:
                outputs.append(output_now)
            if group.finished:
                self._forget(group)
        for request in pooled:
            outputs.append(self._finish_pooling(request, output.pooled))
        clock.lap("detokenize")
        if not self.scheduler.has_unfinished_requests():
            self._flush_finished()
        return outputs

    def _sample_of(self, request_id: str) -> SampleState | None:
        entry = self._samples.get(request_id)
        return entry[0].samples[entry[1]] if entry is not None else None

    @staticmethod
    def _new_tokens(updated: list[Request], output: ModelRunnerOutput) -> list[tuple[Request, int]]:
        counts = dict(zip(output.req_ids, (len(t) for t in output.sampled_token_ids)))
        return [(r, counts[r.request_id]) for r in updated]

    def _process(
        self,
        sample: SampleState,
        num_new: int,
        logprobs: LogprobsLists | None,
        texts: LogprobTexts,
    ) -> None:
        """Take a sample's new tokens (``take_tokens``); a stop string ends its request."""
        request, detok = sample.request, sample.detokenizer
        if take_tokens(sample, num_new, logprobs, texts):
            request.stop_reason = detok.stop_string
            if request.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        if request.is_finished:
            detok.finish()

    def make_output(self, group: RequestGroup) -> RequestOutput | None:
        """The group's output as its ``output_kind`` asks (None: nothing to emit now)."""
        return make_request_output(group)

    def _finish_pooling(
        self, request: Request, pooled: dict[str, list[float]]
    ) -> PoolingRequestOutput:
        state = self._pooling.pop(request.request_id)
        vector = pooled.get(request.request_id)
        if vector is None:
            raise RuntimeError(f"the workers returned no pooled vector for {request}")
        return pooling_output(state, vector)

    def _flush_finished(self) -> None:
        """Tell the workers to drop finished requests' state (and to store the prompt blocks
        they completed, under ``kv_transfer_config``) now rather than at the next step (after
        the batches in flight, whose last one flushes)."""
        kv = self.scheduler.kv_transfer
        if not (self.scheduler._finished_req_ids or (kv and kv.has_saves)) or self._batches:
            return
        sched = self.scheduler.schedule()
        self.executor.execute_model(make_execute_model_request(sched))

    def _check_alive(self) -> None:
        if self.executor.is_dead:
            raise EngineDeadError("the engine's workers are dead; build a new engine to continue")

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if a worker is gone."""
        self.executor.check_health()

    # ---- introspection ------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, batches still in flight (whose outputs a step takes), or
        blocks held for another engine's read (released by a step)."""
        kv = self.scheduler.kv_transfer
        pending = kv is not None and kv.has_pending
        return self.scheduler.has_unfinished_requests() or bool(self._batches) or pending

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def get_kv_cache_stats(self) -> KVCacheStats:
        return self.block_manager.stats()

    def core_loads(self) -> list[tuple[EngineCounters, float]]:
        """Each data-parallel core's counters and KV usage; none for a single core."""
        return []

    def counters(self) -> EngineCounters:
        """The scheduler's and prefix caches' numbers for metrics."""
        return engine_counters(self.scheduler, self.block_manager)

    def request_state_sizes(self) -> dict[str, int]:
        """How many entries each per-request table of the head holds (all 0 once idle): a
        leak check for soak tests and operators."""
        return {
            "groups": len(self._groups),
            "samples": len(self._samples),
            "pooling_requests": len(self._pooling),
            "batches_in_flight": len(self._batches),
            "grammar_matchers": sum(
                s.grammar is not None for g in self._groups.values() for s in g.samples
            ),
            **scheduler_state_sizes(self.scheduler),
        }

    def check_integrity(self) -> None:
        """Block manager invariants, plus: every live request is in exactly one queue."""
        check_scheduler_integrity(self.scheduler)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.executor.shutdown()
