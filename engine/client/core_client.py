"""How the front (``AsyncLLMEngine``) reaches the engine core: ``EngineCoreClient``.

``InProcessCoreClient`` runs the ``EngineCoreLoop`` on a thread of this process (offline async
use, tests). ``cluster.serving.head_client.HeadCoreClient`` reaches the same loop in a Ray actor
of its own (the head of a Serve replica). Either way the front sees one ``StepOutputs`` per step.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from engine.client.core_loop import EngineCoreLoop
from engine.client.core_messages import AddRequest, AddResult, CoreStats, StepOutputs
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.errors import EngineDeadError

OnStep = Callable[[StepOutputs], None]
OnDead = Callable[[EngineDeadError], None]


class EngineCoreClient(ABC):
    """The core as the front sees it. ``on_step`` / ``on_dead`` (given once, to ``start``) may
    be called from any thread; the front hands items to each stream's own event loop."""

    config: EngineConfig

    @abstractmethod
    def start(self, on_step: OnStep, on_dead: OnDead) -> None: ...

    @abstractmethod
    async def add_request(self, request: AddRequest) -> AddResult:
        """Raises ``InvalidRequestError`` / ``EngineOverloadedError`` (nothing enqueued) or
        ``EngineDeadError``."""

    @abstractmethod
    def abort(self, request_ids: list[str]) -> None:
        """Fire and forget: each aborted request's stream ends with finish_reason "abort"."""

    @abstractmethod
    async def stats(self) -> CoreStats: ...

    @abstractmethod
    async def request_state(self) -> dict[str, Any]: ...

    @abstractmethod
    async def control(self, name: str, args: tuple[Any, ...] = ()) -> Any:
        """One of the engine's ``CONTROLS`` between steps (sleep, wake_up, ...); raises
        ``InvalidRequestError`` (a bad argument) or ``EngineStateError`` (busy, asleep)."""

    @abstractmethod
    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the core, a worker or the link to them is gone."""

    @property
    @abstractmethod
    def is_dead(self) -> bool: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InProcessCoreClient(EngineCoreClient):
    """The core loop on a thread of this process. Given a factory, the engine is built on that
    thread (see ``EngineCoreLoop``)."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        self._on_step: OnStep | None = None
        self._on_dead: OnDead | None = None
        self.loop = EngineCoreLoop(engine, self._deliver, self._died)
        self.engine = self.loop.engine
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer

    def start(self, on_step: OnStep, on_dead: OnDead) -> None:
        self._on_step, self._on_dead = on_step, on_dead

    def _deliver(self, step: StepOutputs) -> None:
        if self._on_step is not None:
            self._on_step(step)

    def _died(self, error: EngineDeadError) -> None:
        if self._on_dead is not None:
            self._on_dead(error)

    async def add_request(self, request: AddRequest) -> AddResult:
        return await asyncio.wrap_future(self.loop.add(request))

    def abort(self, request_ids: list[str]) -> None:
        self.loop.abort(request_ids)

    async def stats(self) -> CoreStats:
        return await asyncio.wrap_future(self.loop.stats())

    async def request_state(self) -> dict[str, Any]:
        return await asyncio.wrap_future(self.loop.request_state())

    async def control(self, name: str, args: tuple[Any, ...] = ()) -> Any:
        return await asyncio.wrap_future(self.loop.control(name, args))

    async def check_health(self) -> None:
        self.loop.check_health()

    @property
    def is_dead(self) -> bool:
        return self.loop.is_dead

    def shutdown(self) -> None:
        self.loop.shutdown()


__all__ = ["EngineCoreClient", "InProcessCoreClient", "OnDead", "OnStep"]
