"""Why a model replica cannot start, when the cause is known: a checkpoint or config the engine
refuses (``ConfigError``, a ``ValueError`` from building or loading the model, a missing file),
a port in use, or out of memory. Starting the same replica again fails the same way, so the
deployment fails at the first such failure (``cluster.ops.deploy``) with this one-line reason
instead of Serve retrying it and ending in a traceback.

    head actor:  build fails ─▶ known_start_failure(exc) ─▶ ready() returns the reason
    replica:     LLMServer.__init__ raises ModelStartError("model 'm' cannot start: <reason>")
    Serve:       the deployment's status message holds the replica's traceback text
    deploy side: start_failure(message) finds that line ─▶ app deleted, reason printed

Serve passes a constructor's exception to the controller as traceback text only, so the deploy
side reads the reason from the ``ModelStartError`` line of the deployment's message.
"""

from __future__ import annotations

import errno
import re
import sys
from collections.abc import Iterator

from ray.exceptions import RayTaskError

from engine.errors import ConfigError

_MAX_REASON_CHARS = 1000
# Serve's status message for a replica whose constructor raised: its traceback text, whose
# last ModelStartError line is "<module>.ModelStartError: model '<id>' cannot start: <reason>".
_MESSAGE_LINE = re.compile(r"ModelStartError: (model .* cannot start: .*)$", re.MULTILINE)


class EngineStartError(RuntimeError):
    """The engine of a replica's head actor cannot start, for a known cause: the message is
    its one-line reason."""


class ModelStartError(RuntimeError):
    """A replica of ``model_id`` cannot start, for a known cause (``reason``, one line)."""

    def __init__(self, model_id: str, reason: str) -> None:
        super().__init__(f"model {model_id!r} cannot start: {reason}")
        self.model_id = model_id
        self.reason = reason

    def __reduce__(self) -> tuple[type[ModelStartError], tuple[str, str]]:
        return type(self), (self.model_id, self.reason)


def known_start_failure(exc: BaseException) -> str | None:
    """The one-line reason of a start-up failure whose cause is known (anywhere in ``exc``'s
    chain of causes, a Ray task's remote exception included), or None: an unknown failure
    (a bug, a lost node) that Serve may well cure by retrying."""
    for link in _causes(exc):
        reason = _known_reason(link)
        if reason is not None:
            return _one_line(reason)
    return None


def start_failure(message: str) -> str | None:
    """The ``ModelStartError`` message ("model 'm' cannot start: ...") in a deployment's status
    message from Serve, or None."""
    found = _MESSAGE_LINE.findall(message or "")
    return found[-1].strip() if found else None


def _causes(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RayTaskError):
            # The remote exception, not Ray's wrapper (whose text is a whole traceback).
            exc = exc.cause
            continue
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _known_reason(exc: BaseException) -> str | None:
    if isinstance(exc, ModelStartError):
        return exc.reason
    if isinstance(exc, EngineStartError):
        return str(exc)
    if isinstance(exc, ConfigError):
        return str(exc)
    if isinstance(exc, OSError):
        if exc.errno == errno.EADDRINUSE:
            return f"port in use: {exc}"
        if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError,
                            PermissionError)):  # fmt: skip
            return str(exc)
        return None
    if isinstance(exc, MemoryError) or _is_torch_oom(exc):
        text = str(exc)
        return text if "memory" in text.lower() else f"out of memory: {text}".rstrip(": ")
    if isinstance(exc, ValueError):  # the model build and loader name the field or tensor
        return str(exc)
    return None


def _is_torch_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # never imported here: a process without it has no OOM
    if torch is not None and isinstance(exc, torch.OutOfMemoryError):
        return True
    # torch's CPU allocator raises a plain RuntimeError.
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    if len(line) > _MAX_REASON_CHARS:
        line = line[: _MAX_REASON_CHARS - 3] + "..."
    return line or "(no message)"


__all__ = ["EngineStartError", "ModelStartError", "known_start_failure", "start_failure"]
