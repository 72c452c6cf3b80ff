"""Many models on few devices (``sleep_mode.max_awake_models`` in the deployment YAML): of the
models with a ``sleep_config``, at most that many are awake at once. The ingress admits each
request here before sending it; when its model sleeps and the limit is reached, the least
recently used awake model is put to sleep first (at its ``sleep_config.level``), then the
request goes on and wakes its model (``cluster.serving.sleep_server``).

- A model with requests in flight refuses to sleep (409): the next one in LRU order is tried;
  when every candidate is busy, the request waits (polling) for one to go idle, at most
  ``wake_timeout_s`` (then a 503).
- A model used in the last ``RECENT_S`` is not chosen: its request may still be on its way to
  the replica (which would wake it again at once).
- The ingress keeps the awake set (one ingress replica: the config check requires it). The
  first ``limit`` models start awake, the others asleep with no engine started
  (``DeploymentConfig.starts_asleep``): their first wake starts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from cluster.api.api_errors import APIError

logger = logging.getLogger("llm_cluster.serve")

RECENT_S = 2.0
_POLL_S = 0.2

PutToSleep = Callable[[str], Awaitable[bool]]  # model -> every replica asleep


class AwakeModels:
    """The awake set of ``models`` under ``limit`` (the first ``limit`` start awake);
    ``put_to_sleep`` sleeps one model."""

    def __init__(
        self, models: list[str], limit: int, put_to_sleep: PutToSleep, timeout_s: float
    ) -> None:
        self.models = frozenset(models)
        self.limit = limit
        self.awake = set(models[:limit])
        self.last_used = dict.fromkeys(models, 0.0)
        self._put_to_sleep = put_to_sleep
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()

    async def admit(self, model: str) -> None:
        """Return once ``model`` may wake within the limit (a 503 ``APIError`` after
        ``timeout_s`` of every other awake model being busy)."""
        if model not in self.models:
            return
        self.last_used[model] = time.monotonic()
        if model in self.awake and len(self.awake) <= self.limit:
            return
        async with self._lock:
            deadline = time.monotonic() + self.timeout_s
            while not await self._make_room(model):
                if time.monotonic() > deadline:
                    raise APIError(503, f"model {model!r} cannot wake: the other awake models "
                                        f"stayed busy for {self.timeout_s:g} s",
                                   None, "overloaded", retry_after=5)  # fmt: skip
                await asyncio.sleep(_POLL_S)
            self.awake.add(model)
            self.last_used[model] = time.monotonic()

    async def _make_room(self, model: str) -> bool:
        """Sleep least recently used models until ``model`` fits; True when it does."""
        now = time.monotonic()
        candidates = sorted(self.awake - {model}, key=lambda m: (self.last_used[m], m))
        for victim in candidates:
            if len(self.awake | {model}) <= self.limit:
                break
            if now - self.last_used[victim] < RECENT_S:
                continue
            if await self._put_to_sleep(victim):
                self.awake.discard(victim)
                logger.info("model %s put to sleep to make room for %s", victim, model)
        return len(self.awake | {model}) <= self.limit
