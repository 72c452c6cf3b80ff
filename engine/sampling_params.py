"""``SamplingParams``: what a request asks of decoding, with vLLM's names, defaults and ranges.

It is a ``msgspec.Struct`` so that it travels inside ``ExecuteModelRequest`` through the typed
codec, never through pickle.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.errors import InvalidRequestError

_GREEDY_EPS = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Decoding parameters of one request.

    ``temperature`` 0 means greedy. ``top_k`` 0 (or -1) and ``top_p`` 1 disable those filters.
    ``max_tokens`` None means "up to max_model_len". ``stop`` strings end generation and are
    excluded from the text; ``stop_token_ids`` end it too (the token is kept in ``token_ids``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be >= 0, got {self.temperature!r}",
        )
        _check(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            _is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        if self.seed is not None:
            _check(_is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        if self.max_tokens is not None:
            _check(
                _is_int(self.max_tokens) and self.max_tokens >= 1,
                "max_tokens",
                f"must be >= 1, got {self.max_tokens!r}",
            )
        if self.stop is not None:
            _check(
                isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop),
                "stop",
                "must be a string or a list of strings",
            )
            _check(all(self.stop), "stop", "must not contain empty strings")
        if self.stop_token_ids is not None:
            _check(
                isinstance(self.stop_token_ids, list)
                and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "must be a list of non-negative integers",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
