"""Scoring text pairs (vLLM's ``LLM.score`` and ``/score``, ``/rerank``): how a pair becomes
model input and a score, for both kinds of model the engine serves.

    cross-encoder  (task classify, one class)  the pair as one prompt: the tokenizer's pair
                   encoding (``tokenizer(text_1, text_2)``), or for a causal LM converted by
                   ``method`` ``text_1 + text_2`` encoded as one (``pair_uses_sep_token``);
                   score = its class probability
    bi-encoder     (task embed or generate)    each text embedded alone; score = cosine of
                                               the two (normalised) embeddings

Pairs are ``text_1`` x ``text_2`` as vLLM pairs them: one against many, or many against as
many, position by position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidRequestError


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score, or ``InvalidRequestError`` naming the field."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first:
        raise InvalidRequestError("must hold at least one text", param="text_1")
    if not second:
        raise InvalidRequestError("must hold at least one text", param="text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise InvalidRequestError(
            f"has {len(second)} texts for the {len(first)} of text_1: give one text_1, or as "
            "many as text_2",
            param="text_2",
        )
    return list(zip(first, second, strict=True))


def pair_prompt(tokenizer: Any, text_1: str, text_2: str, sep_token: bool) -> dict[str, Any]:
    """A cross-encoder's prompt for one pair: the tokenizer's pair encoding of the texts
    (``sep_token``), else the two concatenated and encoded as one text (vLLM's rule:
    ``engine.model_heads.pair_uses_sep_token``)."""
    if sep_token:
        ids = tokenizer(text=text_1, text_pair=text_2)["input_ids"]
    else:
        ids = tokenizer(text=text_1 + text_2)["input_ids"]
    return {"prompt_token_ids": list(ids)}


def single_class(num_labels: int, model: str) -> None:
    """A cross-encoder scores with one class (its probability is the score)."""
    if num_labels != 1:
        raise InvalidRequestError(
            f"{model} classifies into {num_labels} classes; scoring needs a one-class "
            "(cross-encoder) model: use /classify",
            param="model",
        )


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors (1.0 for two equal unit vectors)."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0


__all__ = ["cosine", "pair_prompt", "score_pairs", "single_class"]
