"""Structured outputs under speculative decoding: proposals checked against the grammar, and the
grammar's next-token bitmask at each position the step verifies.

The head's matcher only ever advances over emitted (verified) tokens; here it is walked over the
proposals and rolled back. A proposal the grammar rejects ends the proposals there (it could
never be accepted: its row's mask removes it). A proposal that would complete the grammar ends
them too: without speculation the request finishes right after that token, so no row may
follow it. Row j of a request's k + 1 bitmask rows is the mask after proposals [0, j): the
worker masks logits row j with it before verification, so each emitted token (accepted
proposal, correction or bonus) is drawn from the masked distribution of its position, as
without speculation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.structured_output import StructuredOutputGrammar
from engine.core.xgrammar_lib import xgrammar


def grammar_proposals(grammar: StructuredOutputGrammar, proposals: list[int]) -> list[int]:
    """The longest prefix of ``proposals`` the grammar accepts without completing."""
    if not grammar.active or not proposals:
        return []  # a dormant grammar (still reasoning) decodes one token per step
    matcher = grammar.matcher
    kept = 0
    for token in proposals:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        kept += 1
        if matcher.is_terminated():
            matcher.rollback(1)
            kept -= 1
            break
    if kept:
        matcher.rollback(kept)
    return proposals[:kept]


def spec_bitmask_rows(
    grammar: StructuredOutputGrammar, proposals: list[int], vocab_size: int
) -> torch.Tensor:
    """[k + 1, words] int32: the grammar's next-token mask before each proposal and after the
    last (``proposals`` were checked by ``grammar_proposals``)."""
    k = len(proposals)
    bitmask = xgrammar().allocate_token_bitmask(k + 1, vocab_size)
    matcher = grammar.matcher
    for j in range(k + 1):
        matcher.fill_next_token_bitmask(bitmask, j)
        if j < k and not matcher.accept_token(proposals[j]):
            matcher.rollback(j)
            raise RuntimeError(f"spec_bitmask_rows: proposal {j} was not checked")
    if k:
        matcher.rollback(k)
    return bitmask


def spec_grammar_rows(
    spec_token_ids: dict[str, list[int]],
    grammar_of: Callable[[str], StructuredOutputGrammar | None],
    vocab_size: int,
) -> tuple[list[str], bytes]:
    """The step message's rows for the constrained requests verifying proposals: k + 1 rows
    each (one per logits row), the request id repeated for each; they follow the one-row
    requests' rows in ``structured_output_req_ids``."""
    req_ids: list[str] = []
    rows: list[bytes] = []
    for rid, proposals in spec_token_ids.items():
        grammar = grammar_of(rid)
        if grammar is None:
            continue
        bitmask = spec_bitmask_rows(grammar, proposals, vocab_size)
        req_ids.extend([rid] * (len(proposals) + 1))
        rows.append(bitmask.numpy().astype("<i4", copy=False).tobytes())
    return req_ids, b"".join(rows)
