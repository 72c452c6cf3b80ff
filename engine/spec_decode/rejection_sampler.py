"""Verification of proposed tokens against the target model's distribution.

A request verifying k proposals x_1..x_k gets k + 1 logits rows from one forward pass over
[last token, x_1, .., x_k]: row j is the target's distribution p_j of the token after x_j
(row 0: after the last token). Each row is processed exactly as the plain sampler would
(logit_bias, temperature, min_p, top-k, top-p), so p_j is what sampling without speculation
would draw from at that position.

    greedy:  accept x_{j+1} while it equals argmax p_j; then emit argmax p_j at the first
             mismatch (or argmax p_k, the bonus token, after all k were accepted).
    random:  the proposals are a point mass q (n-gram lookup), so the standard rejection rule
             min(1, p(x) / q(x)) accepts x_{j+1} with probability p_j(x_{j+1}); on the first
             rejection the token is drawn from normalize(max(0, p_j - q)) = p_j without
             x_{j+1}, renormalized; after all k accepted, the bonus token is drawn from p_k.

Each emitted token is then distributed exactly as p at its position (Leviathan et al. 2023),
so the output distribution equals sampling without speculation. A seeded request draws its
k + 1 uniforms from its own generator every step (k acceptance tests, one final draw), so its
tokens are reproducible and independent of the batch.

History-dependent processors (penalties, bad_words, min_tokens) see, at row j, the request's
output followed by the proposals before row j: the history sampling without speculation would
see at that position. ``logprobs`` of each emitted token are the raw logprobs of its row, as
sampling without speculation reports them for that position (``spec_logprobs``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from engine.sampling_params import SamplingParams
from engine.worker.sampler import (
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    gather_logprobs,
    process_logits,
)
from engine.worker.step_messages import LogprobsLists


def verify_proposals(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    proposals: list[list[int]],
    vocab_size: int,
    *,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
    eos_token_ids: Sequence[Collection[int]] | None = None,
) -> list[list[int]]:
    """``logits``: [sum(k_i + 1), V], request i's k_i + 1 rows in order. Returns each
    request's emitted tokens: its accepted proposals, then one sampled (or bonus) token.
    ``prompt_token_ids`` / ``output_token_ids`` / ``eos_token_ids`` (per request) are needed
    by penalties, bad_words and min_tokens, as for ``SamplingMetadata.build``."""
    device = logits.device
    rows = [(i, j) for i, prop in enumerate(proposals) for j in range(len(prop) + 1)]
    row_params = [params[i] for i, _ in rows]
    histories = {}
    if output_token_ids is not None:
        # Row j sees the output so far followed by the proposals before it.
        histories["output_token_ids"] = [[*output_token_ids[i], *proposals[i][:j]] for i, j in rows]
    if prompt_token_ids is not None:
        histories["prompt_token_ids"] = [prompt_token_ids[i] for i, _ in rows]
    if eos_token_ids is not None:
        histories["eos_token_ids"] = [eos_token_ids[i] for i, _ in rows]
    meta = SamplingMetadata.build(
        row_params, [None] * len(row_params), vocab_size, device, **histories
    )
    processed = process_logits(logits, meta)
    argmax = processed.argmax(dim=-1).tolist()
    offsets = [0]
    for prop in proposals:
        offsets.append(offsets[-1] + len(prop) + 1)
    if meta.all_greedy:
        return [
            _accept_greedy(prop, argmax[offsets[i] : offsets[i + 1]])
            for i, prop in enumerate(proposals)
        ]
    probs = _probs(processed, meta)
    return _accept_random(probs, argmax, params, generators, proposals, offsets)


def _probs(processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    logits = processed / meta.temperature.unsqueeze(1)
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    return apply_top_k_top_p(logits, meta.top_k, meta.top_p).softmax(dim=-1)


def _accept_greedy(proposal: list[int], argmax: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(proposal) and proposal[accepted] == argmax[accepted]:
        accepted += 1
    return proposal[:accepted] + [argmax[accepted]]


def _uniforms(
    proposals: list[list[int]], generators: list[torch.Generator | None], device: torch.device
) -> list[torch.Tensor]:
    """k + 1 uniforms per request: seeded ones from their generator, the rest in one draw."""
    shared = torch.rand(sum(len(p) + 1 for p in proposals), device=device)
    out, offset = [], 0
    for prop, gen in zip(proposals, generators):
        n = len(prop) + 1
        out.append(
            shared[offset : offset + n]
            if gen is None
            else torch.rand(n, generator=gen, device=device)
        )
        offset += n
    return out


def _accept_random(
    probs: torch.Tensor,
    argmax: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    proposals: list[list[int]],
    offsets: list[int],
) -> list[list[int]]:
    device = probs.device
    rows = [offsets[i] + j for i, prop in enumerate(proposals) for j in range(len(prop))]
    tokens = [t for prop in proposals for t in prop]
    p_x = probs[torch.tensor(rows, dtype=torch.int64, device=device), tokens].tolist()
    uniforms = torch.cat(_uniforms(proposals, generators, device)).tolist()
    results: list[list[int]] = []
    final_rows, banned, final_u, slots = [], [], [], []
    cursor = 0
    for i, (prop, p) in enumerate(zip(proposals, params)):
        k, base = len(prop), offsets[i]
        if p.greedy:
            results.append(_accept_greedy(prop, argmax[base : base + k + 1]))
            cursor += k
            continue
        u = uniforms[base : base + k + 1]
        accepted = 0
        while accepted < k and u[accepted] < p_x[cursor + accepted]:
            accepted += 1
        cursor += k
        results.append(prop[:accepted])
        final_rows.append(base + accepted)
        banned.append(prop[accepted] if accepted < k else -1)
        final_u.append(u[k])
        slots.append(i)
    if final_rows:
        drawn = _draw(probs, final_rows, banned, final_u)
        for slot, token in zip(slots, drawn):
            results[slot].append(token)
    return results


def _draw(probs: torch.Tensor, rows: list[int], banned: list[int], u: list[float]) -> list[int]:
    """Inverse-CDF draws from ``probs[rows]`` with the rejected proposal (``banned``, -1 for
    none) removed: the residual max(0, p - q) of a point-mass q, renormalized by the draw."""
    device = probs.device
    dist = probs[torch.tensor(rows, dtype=torch.int64, device=device)].clone()
    ban_rows = [r for r, b in enumerate(banned) if b >= 0]
    if ban_rows:
        dist[ban_rows, [banned[r] for r in ban_rows]] = 0.0
    cdf = dist.cumsum(dim=-1)
    # 1 - u lies in (0, 1]: a zero-probability prefix (cdf 0) can never be reached.
    targets = (1.0 - torch.tensor(u, device=device).unsqueeze(1)) * cdf[:, -1:]
    ids = torch.searchsorted(cdf, targets).squeeze(1)
    return ids.clamp_(max=probs.shape[-1] - 1).tolist()


def spec_logprobs(
    raw_logprobs: torch.Tensor,
    emitted: list[list[int]],
    proposals: list[list[int]],
    num_logprobs: list[int | None],
) -> list[LogprobsLists | None]:
    """Per request, one row per emitted token: the token's raw logprob in its row, its rank,
    and the row's top-k (``num_logprobs``; None where the request asked for none)."""
    rows, chosen, offset = [], [], 0
    for tokens, prop, k in zip(emitted, proposals, num_logprobs):
        if k is not None:
            rows.extend(range(offset, offset + len(tokens)))
            chosen.extend(tokens)
        offset += len(prop) + 1
    if not rows:
        return [None] * len(emitted)
    device = raw_logprobs.device
    top = max(k for k in num_logprobs if k is not None)
    tensors = gather_logprobs(
        raw_logprobs[torch.tensor(rows, device=device)],
        torch.tensor(chosen, dtype=torch.int64, device=device),
        min(top, raw_logprobs.shape[-1]),
    )
    ids, lps, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    out: list[LogprobsLists | None] = []
    cursor = 0
    for tokens, k in zip(emitted, num_logprobs):
        if k is None:
            out.append(None)
            continue
        span = slice(cursor, cursor + len(tokens))
        cursor += len(tokens)
        out.append(
            LogprobsLists(
                token_ids=[t[: k + 1] for t in ids[span]],
                logprobs=[lp[: k + 1] for lp in lps[span]],
                ranks=ranks[span],
            )
        )
    return out
