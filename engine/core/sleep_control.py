"""Sleep mode on the head (vLLM's names and levels): ``sleep`` / ``wake_up`` / ``is_sleeping``
/ ``reset_prefix_cache`` of ``LLMEngine``, mixed into it.

The head decides and keeps the state; every worker frees and restores its part at once
(``engine.worker.sleep_mode`` says what each level lets go of). While asleep, ``add_request``
raises ``EngineSleepingError``; ``wake_up`` brings the weights back before the KV cache.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.errors import EngineSleepingError, EngineStateError, InvalidRequestError
from engine.lora import LoRASlotTable
from engine.worker.sleep_mode import WAKE_TAGS, check_sleep_level, check_wake_tags

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.block_manager import BlockManager
    from engine.worker.executor import Executor

logger = logging.getLogger("llm_cluster.engine")


class SleepControl:
    """The engine's sleep state: the level slept at (None: awake) and what is still asleep.
    Mixed into ``LLMEngine``, whose ``_flush_finished``, ``has_unfinished_requests`` and
    ``get_num_unfinished_requests`` it calls."""

    config: EngineConfig
    executor: Executor
    block_manager: BlockManager
    lora_slots: LoRASlotTable | None
    _sleep_level: int | None = None
    _asleep: frozenset[str] = frozenset()

    def _check_awake(self) -> None:
        if self._sleep_level is not None:
            raise EngineSleepingError(self._sleep_level)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode, idle only: level 1 frees the workers' KV cache (weights kept in
        host memory), level 2 the weights too. Lost: the prefix cache; at level 2 the loaded
        LoRA adapters too (they load again when next used). Requests are refused
        (``EngineSleepingError``) until ``wake_up``."""
        level = check_sleep_level(level)
        self._check_awake()
        transfer = self.config.kv_transfer.kv_transfer_config
        if transfer is not None and transfer.kv_connector == "NixlConnector":
            # Its agents registered the KV cache's memory and handed it to decode engines.
            raise EngineStateError("sleep: not with kv_connector NixlConnector")
        self._flush_finished()
        if self.has_unfinished_requests():
            raise EngineStateError(
                f"sleep: {self.get_num_unfinished_requests()} requests are unfinished; "
                "an engine sleeps idle (let them finish or abort them first)"
            )
        self.executor.collective_rpc("sleep", (level,))
        self.block_manager.reset_prefix_cache()
        if level == 2 and self.lora_slots is not None:
            self.lora_slots = LoRASlotTable(self.config.lora.max_loras)
        self._sleep_level = level
        self._asleep = frozenset(WAKE_TAGS)
        logger.info("engine asleep (level %d)", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake what ``tags`` names (``weights``, ``kv_cache``; default both), the weights
        first: a cache cannot wake before them. Awake again once both are."""
        woken = [t for t in check_wake_tags(tags) if t in self._asleep]
        if "kv_cache" in woken and "weights" in self._asleep and "weights" not in woken:
            raise InvalidRequestError(
                "the KV cache wakes after the weights (wake 'weights' first)", "tags"
            )
        if woken:
            self.executor.collective_rpc("wake_up", (woken,))
        self._asleep = self._asleep.difference(woken)
        if not self._asleep and self._sleep_level is not None:
            self._sleep_level = None
            logger.info("engine awake")

    def is_sleeping(self) -> bool:
        return self._sleep_level is not None

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's name); False while a request holds blocks."""
        return self.block_manager.reset_prefix_cache()
