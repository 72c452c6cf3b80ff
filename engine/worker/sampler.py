"""Batched sampling over the logits of one step, vectorized over the batch on the logits' device.

Order of operations per row (vLLM v1's):

    raw logits ──▶ raw logprobs (log_softmax; what ``logprobs`` / ``prompt_logprobs`` report)
        │
        ├─ allowed_token_ids: every other token masked
        ├─ min_tokens: EOS and stop_token_ids masked until min_tokens are generated
        ├─ logit_bias: added; bad_words: a word's last token masked when its prefix ends the output
        ├─ penalties: repetition (prompt + output), then frequency and presence (output)
        ▼
    processed logits ──▶ greedy rows: argmax
        │ / temperature
        ├─ min_p: drop tokens with prob < min_p * max prob
        ├─ top-k, top-p
        ▼
    random rows: inverse CDF, the first token whose cumulative probability reaches u ~ U(0, 1]

A seeded request draws its uniform from its own ``torch.Generator``, advanced once per sampled
token, so its tokens do not depend on which other requests share the batch. The only Python loop
per step is over seeded rows (a generator cannot fill a batch of rows); everything else is
built once per step as padded tensors (token histories as ``[B, L]``, per-row pairs for
biases / bans) and applied with scatter / index_put.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class PenaltyTensors:
    prompt_token_ids: torch.Tensor | None  # [B, Lp] int64 padded with vocab_size; repetition only
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor | None  # [B] float32; None if no row uses it


@dataclass
class TokenPairs:
    """Per-(row, token) edits of the logits: a bias to add, or -inf to ban."""

    rows: torch.Tensor  # [K] int64
    tokens: torch.Tensor  # [K] int64
    values: torch.Tensor | None = None  # [K] float32 (logit_bias only)


@dataclass
class BadWordsTensors:
    """One entry per (row, banned sequence): ban ``last`` when ``prefix`` ends the output."""

    rows: torch.Tensor  # [W] int64
    prefixes: torch.Tensor  # [W, P] int64, right-aligned, -1 where the prefix is shorter
    last: torch.Tensor  # [W] int64


@dataclass
class AllowedTokens:
    """The rows that restrict sampling to some tokens (``allowed_token_ids``)."""

    batch_rows: torch.Tensor  # [R] int64: those rows of the batch
    rows: torch.Tensor  # [K] int64: per allowed token, its row's index into batch_rows
    tokens: torch.Tensor  # [K] int64


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32, 1.0 where greedy (unused there)
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [B] float32; None if no row uses it
    min_p: torch.Tensor | None  # [B] float32; None if no row uses it
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    generators: dict[int, torch.Generator]  # batch row -> generator of a seeded request
    # [B, L] int64, each row's generated tokens right-aligned, padded with vocab_size; built
    # only when penalties or bad words need the history.
    output_token_ids: torch.Tensor | None = None
    penalties: PenaltyTensors | None = None
    logit_bias: TokenPairs | None = None
    min_tokens_bans: TokenPairs | None = None
    bad_words: BadWordsTensors | None = None
    allowed: AllowedTokens | None = None
    # Per row: how many top logprobs to return (None: none asked); max over rows, or None.
    num_logprobs: list[int | None] | None = None
    max_num_logprobs: int | None = None
    # Whether any row is greedy, known on the host (reading ``greedy.any()`` would wait for the
    # device mid-step).
    any_greedy: bool = True

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Sequence[Collection[int]] | None = None,
    ) -> SamplingMetadata:
        """``prompt_token_ids`` / ``output_token_ids`` / ``eos_token_ids``: per row, needed only
        by penalties, bad words and min_tokens (empty when not given)."""
        rows = len(params)
        prompts = prompt_token_ids if prompt_token_ids is not None else [()] * rows
        outputs = output_token_ids if output_token_ids is not None else [()] * rows
        eos = eos_token_ids if eos_token_ids is not None else [()] * rows
        greedy = [p.greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        num_logprobs = [p.logprobs for p in params]
        asked = [k for k in num_logprobs if k is not None]
        needs_history = any(p.has_penalties or p.bad_words_token_ids for p in params)
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=_tensor_if(ks, min(ks) < vocab_size, torch.int64, device),
            top_p=_tensor_if(ps, min(ps) < 1.0, torch.float32, device),
            min_p=_tensor_if(min_ps, max(min_ps) > 0.0, torch.float32, device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            generators={i: g for i, g in enumerate(generators) if g is not None},
            output_token_ids=_pad(outputs, vocab_size, device, right_align=True)
            if needs_history
            else None,
            penalties=_build_penalties(params, prompts, vocab_size, device),
            logit_bias=_build_logit_bias(params, vocab_size, device),
            min_tokens_bans=_build_min_tokens_bans(params, outputs, eos, vocab_size, device),
            bad_words=_build_bad_words(params, vocab_size, device),
            allowed=_build_allowed(params, vocab_size, device),
            num_logprobs=num_logprobs if asked else None,
            max_num_logprobs=min(max(asked), vocab_size) if asked else None,
        )


def _tensor_if(
    values: list, used: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    return torch.tensor(values, dtype=dtype, device=device) if used else None


def _pad(
    seqs: Sequence[Sequence[int]], pad: int, device: torch.device, *, right_align: bool = False
) -> torch.Tensor:
    width = max((len(s) for s in seqs), default=0)
    if right_align:
        rows = [[pad] * (width - len(s)) + list(s) for s in seqs]
    else:
        rows = [list(s) + [pad] * (width - len(s)) for s in seqs]
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(seqs), width)


def _build_penalties(
    params: list[SamplingParams],
    prompts: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> PenaltyTensors | None:
    if not any(p.has_penalties for p in params):
        return None
    uses_repetition = any(p.repetition_penalty != 1.0 for p in params)
    return PenaltyTensors(
        prompt_token_ids=_pad(prompts, vocab_size, device) if uses_repetition else None,
        presence=torch.tensor([p.presence_penalty for p in params], device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
        repetition=torch.tensor([p.repetition_penalty for p in params], device=device)
        if uses_repetition
        else None,
    )


def _pairs(
    pairs: list[tuple[int, int]], values: list[float] | None, device: torch.device
) -> TokenPairs | None:
    if not pairs:
        return None
    rows, tokens = zip(*pairs)
    return TokenPairs(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        tokens=torch.tensor(tokens, dtype=torch.int64, device=device),
        values=None if values is None else torch.tensor(values, device=device),
    )


def _build_logit_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> TokenPairs | None:
    pairs, values = [], []
    for row, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            if token < vocab_size:
                pairs.append((row, token))
                values.append(bias)
    return _pairs(pairs, values, device)


def _build_allowed(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> AllowedTokens | None:
    batch_rows: list[int] = []
    indices, tokens = [], []
    for row, p in enumerate(params):
        if p.allowed_token_ids is not None:  # non-empty, within the vocabulary (the head's check)
            kept = [t for t in p.allowed_token_ids if t < vocab_size]
            indices += [len(batch_rows)] * len(kept)
            tokens += kept
            batch_rows.append(row)
    if not batch_rows:
        return None
    return AllowedTokens(
        batch_rows=torch.tensor(batch_rows, dtype=torch.int64, device=device),
        rows=torch.tensor(indices, dtype=torch.int64, device=device),
        tokens=torch.tensor(tokens, dtype=torch.int64, device=device),
    )


def _build_min_tokens_bans(
    params: list[SamplingParams],
    outputs: Sequence[Sequence[int]],
    eos: Sequence[Collection[int]],
    vocab_size: int,
    device: torch.device,
) -> TokenPairs | None:
    pairs = []
    for row, p in enumerate(params):
        if len(outputs[row]) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos[row]))
        pairs.extend((row, t) for t in sorted(stops) if t < vocab_size)
    return _pairs(pairs, None, device)


def _build_bad_words(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> BadWordsTensors | None:
    rows, prefixes, last = [], [], []
    for row, p in enumerate(params):
        for seq in p.bad_words_token_ids or ():
            if seq[-1] < vocab_size:
                rows.append(row)
                prefixes.append(seq[:-1])
                last.append(seq[-1])
    if not rows:
        return None
    return BadWordsTensors(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        prefixes=_pad(prefixes, -1, device, right_align=True),
        last=torch.tensor(last, dtype=torch.int64, device=device),
    )


# ---- logits processors -------------------------------------------------------------------


def apply_penalties(
    logits: torch.Tensor, pen: PenaltyTensors, output_token_ids: torch.Tensor
) -> torch.Tensor:
    """Repetition (HF: divide positive / multiply negative logits of every token in the prompt
    or output), then frequency (- f * count) and presence (- p * [count > 0]) over the output.
    ``output_token_ids``: [B, L] padded with the vocabulary size (a column that is dropped)."""
    rows, vocab = logits.shape
    out_ids = output_token_ids
    counts = torch.zeros(rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    if pen.repetition is not None:
        seen = counts > 0
        if pen.prompt_token_ids is not None and pen.prompt_token_ids.numel():
            in_prompt = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
            in_prompt.scatter_(1, pen.prompt_token_ids, True)
            seen = seen | in_prompt[:, :vocab]
        rp = pen.repetition.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - pen.frequency.unsqueeze(1) * counts
    return logits - pen.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_bad_words(
    logits: torch.Tensor, bad: BadWordsTensors, output_token_ids: torch.Tensor
) -> torch.Tensor:
    """Ban each sequence's last token where its prefix equals the tail of the row's output
    (``output_token_ids`` right-aligned; a one-token word has an empty prefix: always banned)."""
    width = bad.prefixes.shape[1]
    tails = output_token_ids[bad.rows]
    if tails.shape[1] < width:  # outputs shorter than the longest prefix: pad on the left
        tails = torch.nn.functional.pad(tails, (width - tails.shape[1], 0), value=-2)
    tails = tails[:, tails.shape[1] - width :]
    matches = ((tails == bad.prefixes) | (bad.prefixes < 0)).all(dim=1)
    logits = logits.clone()
    logits[bad.rows[matches], bad.last[matches]] = float("-inf")
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already exceeds top_p (the top one stays).
        before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(before > top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_allowed(logits: torch.Tensor, allowed: AllowedTokens) -> torch.Tensor:
    """-inf everywhere but the allowed tokens of the rows that name them."""
    rows = allowed.batch_rows
    banned = torch.ones(len(rows), logits.shape[-1], dtype=torch.bool, device=logits.device)
    banned[allowed.rows, allowed.tokens] = False
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
    return logits


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Everything that changes the distribution before temperature: allowed_token_ids,
    min_tokens, logit_bias, bad_words, penalties. Returns fp32 logits (a new tensor when
    anything applies)."""
    logits = logits.to(torch.float32)
    if meta.allowed is not None:
        logits = apply_allowed(logits, meta.allowed)
    if meta.min_tokens_bans is not None:
        bans = meta.min_tokens_bans
        logits = logits.clone()
        logits[bans.rows, bans.tokens] = float("-inf")
    if meta.logit_bias is not None:
        bias = meta.logit_bias
        logits = logits.index_put((bias.rows, bias.tokens), bias.values, accumulate=True)
    if meta.bad_words is not None and meta.output_token_ids is not None:
        logits = apply_bad_words(logits, meta.bad_words, meta.output_token_ids)
    if meta.penalties is not None and meta.output_token_ids is not None:
        logits = apply_penalties(logits, meta.penalties, meta.output_token_ids)
    return logits


# ---- sampling ----------------------------------------------------------------------------


@dataclass
class LogprobsTensors:
    """Column 0 is the chosen token (sampled, or the actual next prompt token); columns 1.. the
    top-k by raw logprob. ``ranks``: 1-based rank of the chosen token in the raw distribution."""

    token_ids: torch.Tensor  # [N, k + 1] int64
    logprobs: torch.Tensor  # [N, k + 1] float32
    ranks: torch.Tensor  # [N] int64


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


def gather_logprobs(raw_logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> LogprobsTensors:
    """Top-k of each row of ``raw_logprobs`` [N, V] plus the ``chosen`` token's own [N]."""
    top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
    chosen_lp = raw_logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (raw_logprobs >= chosen_lp).sum(dim=-1)  # vLLM's: a tie ranks the token after
    return LogprobsTensors(
        token_ids=torch.cat([chosen.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([chosen_lp, top_lp], dim=1),
        ranks=ranks,
    )


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    """logits [B, V] -> token ids [B] (int64), plus raw logprobs when a row asked for them.
    Everything after the LM head runs in float32 (as vLLM's sampler): a bf16 softmax would
    quantize the probabilities, and torch's CPU bf16 reductions are slower than fp32 ones."""
    logits = logits.to(torch.float32)
    raw_logprobs = None
    if meta.max_num_logprobs is not None:
        raw_logprobs = logits.log_softmax(dim=-1)
    logits = process_logits(logits, meta)
    token_ids = _sample_ids(logits, meta)
    logprobs = None
    if raw_logprobs is not None:
        logprobs = gather_logprobs(raw_logprobs, token_ids, meta.max_num_logprobs or 0)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _sample_ids(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.all_greedy:
        return logits.argmax(dim=-1)
    greedy_ids = logits.argmax(dim=-1) if meta.any_greedy else None
    logits = logits / meta.temperature.unsqueeze(1)
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    random_ids = _inverse_cdf_draw(logits.softmax(dim=-1), meta.generators)
    return random_ids if greedy_ids is None else torch.where(meta.greedy, greedy_ids, random_ids)


def _inverse_cdf_draw(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One uniform per row, located in the row's CDF: the first token whose cumulative
    probability reaches u * total. A seeded row draws its uniform from its own generator, so its
    token does not depend on the rest of the batch. (An exponential race over the whole vocab
    costs ~40x more on CPU: torch draws exponentials one element at a time.)"""
    rows = probs.shape[0]
    u = torch.rand(rows, 1, device=probs.device, dtype=torch.float32)
    for row, generator in generators.items():
        u[row] = torch.rand(1, generator=generator, device=probs.device)
    cdf = probs.to(torch.float32).cumsum(dim=-1)
    # 1 - u lies in (0, 1]: a zero-probability prefix (cdf 0) can never be reached.
    targets = (1.0 - u) * cdf[:, -1:]
    ids = torch.searchsorted(cdf, targets).squeeze(1)
    return ids.clamp_(max=probs.shape[-1] - 1)
