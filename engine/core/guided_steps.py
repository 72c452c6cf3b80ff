"""What a step adds on the head for structured outputs and speculative decoding.

The engine core (``engine.core.llm_engine``) calls these around each batch:

    schedule  -> add_grammar_bitmask   rows of the constrained samples that sample this step
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

from engine.core.output_processor import SampleState
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.core.structured_output import StructuredOutputGrammar, StructuredOutputManager
from engine.spec_decode.grammar import grammar_proposals, spec_grammar_rows
from engine.spec_decode.metrics import SpecDecodeStats
from engine.spec_decode.ngram import NgramProposer
from engine.worker.step_messages import ExecuteModelRequest, ModelRunnerOutput

logger = logging.getLogger("llm_cluster.engine")


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
