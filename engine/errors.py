"""Exceptions the engine raises for callers to map (HTTP status, gRPC code)."""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from typing import Any


class InvalidRequestError(ValueError):
    """A request is invalid; ``param`` names the offending field. Nothing was enqueued."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.reason = message


def check_request_id_unused(request_id: str, *in_use: Container[str]) -> None:
    """Raise ``InvalidRequestError`` (param ``request_id``) when any of ``in_use`` holds it."""
    if any(request_id in ids for ids in in_use):
        raise InvalidRequestError(f"{request_id!r} is already in use", param="request_id")


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at its cap (``max_waiting_requests`` / ``max_waiting_tokens``);
    nothing was enqueued. Clients should retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine (or one of its workers) failed; in-flight requests cannot complete."""


class RequestFailedError(RuntimeError):
    """Taking one request raised an error the engine does not expect (its log has the
    traceback): that request fails, and the engine goes on serving the others."""


class EngineStateError(RuntimeError):
    """The engine's state does not allow the call now (busy with requests, or asleep)."""


class EngineSleepingError(EngineStateError):
    """The engine sleeps (``LLMEngine.sleep``): nothing was enqueued; ``wake_up`` first."""

    def __init__(self, level: int) -> None:
        super().__init__(f"the engine is asleep (sleep level {level}); call wake_up() first")
        self.level = level


class RequestAbortedError(RuntimeError):
    """A request that returns one final output (an embedding) was aborted before it had one:
    ``abort``, or a replica draining for shutdown. Nothing of it is left in the engine."""


class ConfigError(ValueError):
    """A configuration value is unknown or out of range; the message names the key."""


def check_positive_ints(config: Mapping[str, Any], keys: Iterable[str], prefix: str = "") -> None:
    """Raise ``ConfigError`` naming ``prefix + key`` for the first of ``keys`` whose value in
    ``config`` is not a positive integer (a bool is not one)."""
    for key in keys:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{prefix}{key}: must be a positive integer, got {value!r}")
