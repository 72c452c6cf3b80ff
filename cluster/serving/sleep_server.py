"""The sleep half of ``LLMServer`` (mixed into it): a replica's engine put to sleep and woken
(``LLMEngine.sleep`` / ``wake_up``, vLLM's levels), by the admin routes, ``cluster sleep|wake``,
the model's idle timer (``sleep_config``) or the next request.

    awake ──sleep(level): idle only (409 while requests are in flight)──────────▶ asleep
      ▲                                                                         │
      └──── wakeup(), or a request: it waits (up to wake_timeout_s) and runs ◀───┘

Transitions take one lock, so a request that arrives while the replica falls asleep waits for
the sleep to finish, then wakes it: nothing accepted is refused for sleeping. A replica started
asleep (``start_asleep``: a model beyond ``sleep_mode.max_awake_models``) reports level 2 and has
no engine yet; its first wake starts one (any ``tags``: it starts whole). A request counts
as in flight from its arrival (``_active``), so a replica never sleeps under one. Serve's
``Ray Serve LLM`` names: ``sleep``, ``wakeup``, ``is_sleeping``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from engine.errors import EngineDeadError, EngineStateError, InvalidRequestError
from engine.worker.sleep_mode import check_sleep_level, check_wake_tags

logger = logging.getLogger("llm_cluster.serve")

_IDLE_POLL_S = 1.0


class SleepServer:
    """Sleep state and transitions over ``LLMServer``'s engine and request tracking."""

    engine: Any  # None until a replica started asleep first wakes
    model_id: str
    metrics: Any
    _active: set[str]

    _start_core: Callable[[], None]  # LLMServer's: start the engine (blocks until loaded)

    def _init_sleep(self, sleep_config: dict[str, Any] | None, started: bool = True) -> None:
        config = sleep_config or {}
        self.sleep_level: int | None = None if started else 2  # None: awake
        self._transition = asyncio.Lock()
        self._idle_after_s: float | None = config.get("sleep_after_idle_s")
        self._idle_level: int = config.get("level", 1)
        self._wake_timeout_s: float = config.get("wake_timeout_s", 300.0)
        self._last_busy = time.monotonic()
        self._idle_task: asyncio.Task[None] | None = None
        self._starting: asyncio.Future[None] | None = None
        if not started:
            self.metrics.on_start_asleep()

    # ---- the handle calls (admin routes, cluster sleep / wake) ---------------------------

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Put the engine to sleep at ``level``; ``{"sleeping": level}``, or an ``error`` (400
        a bad level, 409 requests in flight) with its ``status``."""
        try:
            check_sleep_level(level)  # (also when asleep already: a bad level is a 400)
        except InvalidRequestError as exc:
            return _refused(400, str(exc))
        async with self._transition:
            if self.sleep_level is not None:
                return self.sleep_state()
            if self._active:
                return _refused(409, f"model {self.model_id!r} has {len(self._active)} requests "
                                     "in flight; it sleeps when idle")  # fmt: skip
            started = time.monotonic()
            try:
                await self.engine.sleep(level)
            except InvalidRequestError as exc:
                return _refused(400, str(exc))
            except EngineStateError as exc:
                return _refused(409, str(exc))
            self.sleep_level = level
            self.metrics.on_sleep(level, time.monotonic() - started)
            logger.info("model %s asleep (level %d)", self.model_id, level)
        return self.sleep_state()

    async def wakeup(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Wake the engine (``tags``: only the weights, or only the KV cache after them)."""
        try:
            check_wake_tags(tags)
            await self._wake(tags)
        except InvalidRequestError as exc:
            return _refused(400, str(exc))
        return self.sleep_state()

    async def is_sleeping(self) -> bool:
        return self.sleep_level is not None

    def sleep_state(self) -> dict[str, Any]:
        return {"model": self.model_id, "is_sleeping": self.sleep_level is not None,
                "sleep_level": self.sleep_level}  # fmt: skip

    # ---- requests ---------------------------------------------------------------------------

    async def _ensure_awake(self) -> None:
        """Before a request reaches the engine: wake it if it sleeps (or is falling asleep),
        within ``wake_timeout_s``; ``EngineDeadError`` (a 503) if it does not wake."""
        self._last_busy = time.monotonic()
        self._ensure_idle_timer()
        if self.sleep_level is None and not self._transition.locked():
            return
        try:
            await asyncio.wait_for(self._wake(None), self._wake_timeout_s)
        except TimeoutError as exc:
            raise EngineDeadError(
                f"model {self.model_id!r} did not wake within {self._wake_timeout_s:g} s"
            ) from exc

    async def _wake(self, tags: list[str] | None) -> None:
        async with self._transition:
            if self.sleep_level is None:
                return
            started = time.monotonic()
            if self.engine is None:
                await self._start_engine()
            else:
                await self.engine.wake_up(tags)
            if not await self.engine.is_sleeping():
                self.sleep_level = None
                self.metrics.on_wake(time.monotonic() - started)
                logger.info("model %s awake in %.2f s", self.model_id,
                            time.monotonic() - started)  # fmt: skip

    async def _start_engine(self) -> None:
        """Start a replica's engine that started asleep, off the event loop (health checks and
        the other calls go on meanwhile). One start at a time: a wake that times out leaves
        it running, and the next wake waits for the same start."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(asyncio.to_thread(self._start_core))
        starting = self._starting
        try:
            await asyncio.shield(starting)
        except Exception as exc:
            logger.exception("model %s: its engine failed to start", self.model_id)
            raise EngineDeadError(f"model {self.model_id!r} failed to start: {exc}") from exc
        finally:
            if starting.done():
                self._starting = None

    # ---- the idle timer (sleep_config.sleep_after_idle_s) -----------------------------------

    def _ensure_idle_timer(self) -> None:
        if self._idle_after_s is None or (self._idle_task and not self._idle_task.done()):
            return
        loop = asyncio.get_running_loop()
        self._idle_task = loop.create_task(self._sleep_when_idle(self._idle_after_s))

    async def _sleep_when_idle(self, after: float) -> None:
        while True:
            await asyncio.sleep(min(_IDLE_POLL_S, after))
            now = time.monotonic()
            if self._active or self._transition.locked():
                self._last_busy = now
            elif self.sleep_level is None and now - self._last_busy >= after:
                with contextlib.suppress(EngineDeadError):
                    await self.sleep(self._idle_level)
                self._last_busy = time.monotonic()


def _refused(status: int, message: str) -> dict[str, Any]:
    return {"error": message, "status": status}
