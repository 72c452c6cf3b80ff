"""``PoolingParams``: what a pooling request asks of the engine (vLLM's name).

A pooling request runs its prompt through the model and pools its final hidden states (after
the final norm: what the LM head sees) by the model's ``pooling_type`` (engine argument:
``last`` or ``mean``) into one vector; it samples no token. Its ``task`` says what comes back:
``embed`` the vector, ``classify`` the classifier's class scores of it (a classification model,
``engine.model_heads``). Like ``SamplingParams`` it is a ``msgspec.Struct``, so it travels in
the typed step message.
"""

from __future__ import annotations

import msgspec

from engine.errors import InvalidRequestError

POOLING_TASKS: tuple[str, ...] = ("embed", "classify")


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``task``: ``embed`` or ``classify`` (None: the model's own; ``embed`` for a generating
    model). ``normalize``: L2-normalise an embedding (vLLM's default). ``dimensions``: keep
    the embedding's first this many dimensions, before normalising (Matryoshka models only:
    ``is_matryoshka`` or ``matryoshka_dimensions`` in the model's config). ``activation``:
    class scores as probabilities (softmax; sigmoid for a single class), else raw logits."""

    task: str | None = None
    normalize: bool = True
    dimensions: int | None = None
    activation: bool = True

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise InvalidRequestError(
                f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}", param="task"
            )
        if not isinstance(self.activation, bool):
            raise InvalidRequestError(
                f"must be a boolean, got {self.activation!r}", param="activation"
            )
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


__all__ = ["POOLING_TASKS", "PoolingParams"]
