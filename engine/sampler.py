"""Batched sampling over the logits of one step: greedy, temperature, top-k, top-p, seeds.

Vectorized over the batch on the logits' device. A seeded request draws its noise from its own
``torch.Generator``, advanced once per sampled token, so its tokens do not depend on which other
requests share the batch. Sampling uses the exponential-race form of the Gumbel trick:
argmax(p / q) with q ~ Exp(1) is a draw from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32, 1.0 where greedy (unused there)
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [B] float32; None if no row uses it
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    generators: dict[int, torch.Generator]  # batch row -> generator of a seeded request

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        greedy = [p.greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        ps = [p.top_p for p in params]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(ks, dtype=torch.int64, device=device)
            if min(ks) < vocab_size
            else None,
            top_p=torch.tensor(ps, dtype=torch.float32, device=device) if min(ps) < 1.0 else None,
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            generators={i: g for i, g in enumerate(generators) if g is not None},
        )


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


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64)."""
    logits = logits.to(torch.float32)
    greedy_ids = logits.argmax(dim=-1)
    if meta.all_greedy:
        return greedy_ids
    logits = apply_top_k_top_p(logits / meta.temperature.unsqueeze(1), meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in meta.generators.items():
        noise[row].exponential_(generator=generator)
    random_ids = (probs / noise).argmax(dim=-1)
    return torch.where(meta.greedy, greedy_ids, random_ids)
