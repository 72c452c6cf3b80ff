"""LoRA on the head: ``LLMEngine``'s adapter checks and device slots, mixed into it.

    add_request ── ``_check_lora``: read and check the adapter (cached in the ``LoRARegistry``),
                   so a bad one is an ``InvalidRequestError`` and never reaches the workers
    schedule    ── ``_assign_lora_slots``: this step's adapters get device slots
                   (``LoRASlotTable``); the changed slots travel in the step's message
    step output ── ``_fail_lora_loads``: an adapter a worker could not load ends its requests
                   and is forgotten, so its next use checks it again

The scheduler keeps the running requests to ``max_loras`` adapters; ``engine.lora`` has the
registry, the slot table and the workers' loader.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.lora import LoRARegistry, LoRARequest, LoRASlotTable

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.output_processor import RequestGroup
    from engine.core.scheduler import Scheduler
    from engine.core.scheduler_output import SchedulerOutput
    from engine.outputs import PoolingRequestOutput, RequestOutput
    from engine.worker.step_messages import ExecuteModelRequest

logger = logging.getLogger("llm_cluster.engine")


class LoRAControl:
    """The engine's adapters: the registry of checked ones and the device slots (both None
    without ``enable_lora``). Mixed into ``LLMEngine``, whose ``abort_request`` it calls and
    whose ``_samples`` it reads."""

    config: EngineConfig
    scheduler: Scheduler
    _samples: dict[str, tuple[RequestGroup, int]]
    lora_registry: LoRARegistry | None
    lora_slots: LoRASlotTable | None

    def _init_lora(self) -> None:
        lora = self.config.lora
        self.lora_registry = (
            LoRARegistry(self.config.model.hf_config, lora.max_lora_rank, lora.max_cpu_loras)
            if lora.enable_lora
            else None
        )
        self.lora_slots = LoRASlotTable(lora.max_loras) if lora.enable_lora else None

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        """Read and check the adapter now (cached), so a bad one never reaches the workers."""
        if lora_request is None:
            return
        if self.lora_registry is None:
            raise InvalidRequestError(
                "LoRA is not enabled on this engine (start it with enable_lora=True)",
                param="lora_request",
            )
        self.lora_registry.get(lora_request, self._live_loras)

    def _live_loras(self) -> list[LoRARequest]:
        return [
            r.lora_request for r in self.scheduler.requests.values() if r.lora_request is not None
        ]

    def _assign_lora_slots(self, sched: SchedulerOutput, message: ExecuteModelRequest) -> None:
        """Give this step's adapters device slots; changed slots travel in the message."""
        if self.lora_slots is None:
            return
        adapters = {}
        for rid in sched.num_scheduled_tokens:
            request = self.scheduler.requests.get(rid)
            if request is not None and request.lora_request is not None:
                adapters[request.lora_int_id] = request.lora_request.lora_path
        if adapters:
            message.lora_slots = self.lora_slots.assign(adapters)

    def _fail_lora_loads(
        self, errors: dict[int, str]
    ) -> list[RequestOutput | PoolingRequestOutput]:
        """Adapters a worker could not load into their slots this step (their files removed or
        changed since the head checked them): before this step's tokens are taken, their
        requests end ("abort", and the error is logged) and the adapter is forgotten, so its
        next use checks it again (a 400 if it is still gone). Other requests are untouched."""
        if not errors:
            return []
        groups: dict[str, int] = {}
        for request in list(self.scheduler.requests.values()):
            if request.lora_int_id in errors and not request.is_finished:
                entry = self._samples.get(request.request_id)
                group_id = entry[0].request_id if entry is not None else request.request_id
                groups[group_id] = request.lora_int_id
        for lid, why in errors.items():
            aborted = sorted(g for g, gl in groups.items() if gl == lid)
            logger.error("LoRA adapter %d: %s; aborting its requests %s", lid, why, aborted)
            if self.lora_registry is not None and self.lora_slots is not None:
                self.lora_registry.forget(lid)
                self.lora_slots.forget(lid)
        return self.abort_request(list(groups))
