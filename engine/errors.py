"""Exceptions the engine raises for callers to map (HTTP status, gRPC code)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request is invalid; ``param`` names the offending field. Nothing was enqueued."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.reason = message


class EngineDeadError(RuntimeError):
    """The engine (or one of its workers) failed; in-flight requests cannot complete."""
