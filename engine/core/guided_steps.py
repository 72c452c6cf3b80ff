"""What a step adds on the head for structured outputs and speculative decoding.

The engine core (``engine.core.llm_engine``) calls these around each batch:

    add       -> PendingGrammars       requests whose grammar compiles (WAITING_FOR_FSM)
    schedule  -> admitted once compiled, attach_grammars gives each sample its matcher
              -> add_grammar_bitmask   rows of the constrained samples that sample this step
    execute
    update    -> observe_spec_decode   count each verification (before stops trim tokens)
              -> advance_grammar       feed the sampled tokens to the sample's matcher
              -> propose               the next step's drafts, cut where a grammar rejects one

A sample's matcher lives on its ``SampleState`` (``engine.core.output_processor``); the
matchers themselves are ``engine.core.structured_output``, the proposers ``engine.spec_decode``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from engine.core.output_processor import RequestGroup, SampleState
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.core.structured_output import StructuredOutputGrammar, StructuredOutputManager
from engine.spec_decode.grammar import grammar_proposals, spec_grammar_rows
from engine.spec_decode.metrics import SpecDecodeStats
from engine.spec_decode.ngram import NgramProposer
from engine.worker.step_messages import ExecuteModelRequest, ModelRunnerOutput

logger = logging.getLogger("llm_cluster.engine")

COMPILE_POLL_S = 0.01  # how long an idle step waits for a grammar compile


class PendingGrammars:
    """The groups whose grammar is compiling (the scheduler holds their first sample in
    ``WAITING_FOR_FSM``): group id -> the compile's future."""

    def __init__(self) -> None:
        self._futures: dict[str, Future[Any]] = {}

    def hold(self, request_id: str, future: Future[Any]) -> None:
        self._futures[request_id] = future

    def forget(self, request_id: str) -> None:
        self._futures.pop(request_id, None)

    def take_done(self) -> list[tuple[str, Future[Any]]]:
        """The compiles that have ended, no longer held."""
        done = [(rid, f) for rid, f in self._futures.items() if f.done()]
        for rid, _ in done:
            del self._futures[rid]
        return done

    def wait(self) -> None:
        """Wait a little for one compile to end, rather than spin on the cores it needs."""
        if self._futures:
            wait(self._futures.values(), timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)


def attach_grammars(
    group: RequestGroup, future: Future[Any], structured_output: StructuredOutputManager
) -> bool:
    """Give each sample of ``group`` a matcher over its compiled grammar (``future``, done);
    False if the compile failed."""
    if future.exception() is not None:
        return False
    spec, skip = group.params.structured_outputs, group.params.skip_special_tokens
    for sample in group.samples:
        sample.grammar = structured_output.new_grammar(spec, skip, future.result())
    return True


def add_grammar_bitmask(
    sched: SchedulerOutput,
    message: ExecuteModelRequest,
    sample_of: Callable[[str], SampleState | None],
    structured_output: StructuredOutputManager,
) -> None:
    """Next-token bitmask rows of the constrained samples that sample this step: those whose
    scheduled tokens reach the end of their known tokens (mid-prompt chunks and recomputed old
    tokens are not sampled, so they get no row), then the rows verifying their drafts."""
    req_ids, grammars = [], []
    for rid, num in sched.num_scheduled_tokens.items():
        sample = sample_of(rid)
        if sample is None or sample.grammar is None:
            continue
        request = sample.request
        if request.num_computed_tokens + num != request.num_tokens:
            continue
        if not sample.grammar.active:  # a reasoning model still reasoning: unconstrained
            continue
        req_ids.append(rid)
        grammars.append(sample.grammar)

    def grammar_of(rid: str) -> StructuredOutputGrammar | None:
        sample = sample_of(rid)
        return sample.grammar if sample is not None else None

    spec_ids, spec_rows = spec_grammar_rows(
        sched.spec_token_ids, grammar_of, structured_output.vocab_size
    )
    if req_ids or spec_ids:
        message.structured_output_req_ids = req_ids + spec_ids
        plain = structured_output.grammar_bitmask(grammars) if grammars else b""
        message.grammar_bitmask = plain + spec_rows


def advance_grammar(sample: SampleState, num_new: int, scheduler: Scheduler) -> None:
    """Feed the sampled tokens to the sample's matcher. A complete grammar (its stop token
    accepted) ends the request as stopped, even with ignore_eos. A rejected token (the mask
    should make that impossible) also stops it, with a warning, rather than emit output the
    grammar does not match."""
    grammar, request = sample.grammar, sample.request
    if grammar is None:
        return
    accepted = grammar.accept_tokens(request.output_token_ids[-num_new:])
    if not accepted:
        logger.warning(
            "%s: the grammar rejected sampled token(s) %s; stopping the request",
            request.request_id,
            request.output_token_ids[-num_new:],
        )
    if (not accepted or grammar.is_terminated()) and not request.is_finished:
        scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
    elif not request.is_finished and _grammar_needs_a_banned_stop(grammar, request):
        # min_tokens bans the stop token, but the document is complete and the grammar
        # allows nothing else: it ends here (sampling from an all-masked row would emit junk).
        scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)


def _grammar_needs_a_banned_stop(grammar: StructuredOutputGrammar, request: Request) -> bool:
    """The sampler bans stop tokens while fewer than ``min_tokens`` are out (EOS too unless
    ``ignore_eos``); whether the grammar allows only such banned tokens next."""
    params = request.sampling_params
    if len(request.output_token_ids) >= params.min_tokens:
        return False
    banned = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        banned |= set(grammar.matcher.stop_token_ids)
    return bool(banned) and grammar.allows_only(banned)


def observe_spec_decode(
    stats: SpecDecodeStats, sched: SchedulerOutput, output: ModelRunnerOutput
) -> None:
    """Count each verification before stops trim the tokens: accepted = emitted - 1."""
    if not sched.spec_token_ids:
        return
    for rid, tokens in zip(output.req_ids, output.sampled_token_ids):
        spec = sched.spec_token_ids.get(rid)
        if spec is not None and tokens:
            stats.observe(len(spec), len(tokens) - 1)


def propose(
    proposer: NgramProposer | None, sample: SampleState, drafts: dict[str, list[int]]
) -> None:
    """Speculative decoding: the proposals the request's next step verifies (n-gram lookup
    here, or the workers' draft model's), cut where a grammar (structured outputs) rejects
    one."""
    if proposer is None:
        return
    request = sample.request
    if proposer.config.method == "draft_model":
        proposals = drafts.get(request.request_id, [])[: proposer.room(request)]
    else:
        proposals = proposer.propose(request)
    if sample.grammar is not None:
        proposals = grammar_proposals(sample.grammar, proposals)
    request.spec_token_ids = proposals
