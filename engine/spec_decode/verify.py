"""The worker's side of speculative decoding: which bitmask rows mask which verification rows,
and one step's verification of every speculating request (grammar mask, then the rejection
sampler, then the emitted tokens' logprobs where asked).

A request verifying k proposals owns k + 1 consecutive logits rows, in ``spec_req_ids``
order, after the one-row requests' rows; a constrained one also owns k + 1 consecutive rows
of the step's bitmask (its request id repeated in ``structured_output_req_ids``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.core.structured_output import apply_grammar_bitmask, unpack_bitmask
from engine.spec_decode.rejection_sampler import spec_logprobs, verify_proposals
from engine.worker.step_messages import ExecuteModelRequest, LogprobsLists


def spec_grammar_rows_of(
    req: ExecuteModelRequest, spec_req_ids: list[str]
) -> tuple[list[int], np.ndarray | None]:
    """(verification rows to mask, their bitmask rows), for the constrained requests among
    ``spec_req_ids``."""
    if not req.structured_output_req_ids or not spec_req_ids:
        return [], None
    offset, start = 0, {}
    for rid in spec_req_ids:
        start[rid] = offset
        offset += len(req.scheduled_spec_decode_tokens[rid]) + 1
    seen: dict[str, int] = {}
    rows, picked = [], []
    for i, rid in enumerate(req.structured_output_req_ids):
        if rid in start:
            rows.append(start[rid] + seen.get(rid, 0))
            seen[rid] = seen.get(rid, 0) + 1
            picked.append(i)
    if not rows:
        return [], None
    bitmask = unpack_bitmask(req.grammar_bitmask, len(req.structured_output_req_ids))
    return rows, bitmask[picked]


def verify_requests(
    states: list[Any],
    proposals: list[list[int]],
    logits: torch.Tensor,
    grammar_bitmask: np.ndarray | None,
    grammar_rows: list[int],
    vocab_size: int,
) -> tuple[list[list[int]], list[LogprobsLists | None] | None]:
    """``states``: the requests' ``CachedRequestState``s (tokens up to their last one).
    Returns each request's emitted tokens, and their logprobs (None when nobody asked)."""
    if grammar_bitmask is not None:
        apply_grammar_bitmask(logits, grammar_bitmask, grammar_rows)
    params = [s.sampling_params for s in states]
    needs_history = any(p.has_penalties or p.bad_words_token_ids or p.min_tokens for p in params)
    num_logprobs = [p.logprobs for p in params]
    # Raw logprobs after the grammar's mask, as the plain sampler reports them.
    raw = (
        logits.to(torch.float32).log_softmax(dim=-1)
        if any(k is not None for k in num_logprobs)
        else None
    )
    emitted = verify_proposals(
        logits,
        params,
        [s.generator for s in states],
        proposals,
        vocab_size,
        prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in states]
        if needs_history
        else None,
        output_token_ids=[s.output_token_ids for s in states] if needs_history else None,
        eos_token_ids=[s.eos_token_ids for s in states],
    )
    if raw is None:
        return emitted, None
    return emitted, spec_logprobs(raw, emitted, proposals, num_logprobs)
