"""``PoolingParams``: what an embedding request asks of the engine (vLLM's name).

A pooling request runs its prompt through the model and returns one vector pooled from the
final hidden states (after the final norm: what the LM head sees), by the model's
``pooling_type`` (engine argument: ``last`` or ``mean``); it samples no token. Like
``SamplingParams`` it is a ``msgspec.Struct``, so it travels in the typed step message.
"""

from __future__ import annotations

import msgspec

from engine.errors import InvalidRequestError


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``normalize``: L2-normalise the pooled vector (vLLM's default for embeddings).
    ``dimensions``: truncate to this many dimensions (Matryoshka models only; the engine
    rejects it for every model it serves today)."""

    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError(
                f"must be a boolean, got {self.normalize!r}", param="normalize"
            )
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
        ):
            raise InvalidRequestError(
                f"must be an integer, got {self.dimensions!r}", param="dimensions"
            )


__all__ = ["PoolingParams"]
