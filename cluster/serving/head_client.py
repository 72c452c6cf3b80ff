"""``HeadCoreClient``: the replica's side of its head (``cluster.serving.head_actor``). The
``LLMServer`` front's ``EngineCoreClient`` when the engine core runs in a ``HeadActor``: it starts
the actor in the replica's placement group, ``wait_started`` waits until its model is loaded,
and then it makes the Ray calls (msgspec bytes both ways) that the front's ``AsyncLLMEngine``
asks for.

    add_request / abort / control / stats ──▶ the head's methods, outside any request's context
    one poll always outstanding          ◀── every step the front has not acknowledged

The poll task hands each step to ``on_step`` once, in order; a lost head (a Ray error, or a poll
reply that says the core died) ends every stream through ``on_dead``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import ray
from ray.exceptions import RayError, TaskCancelledError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.serving.head_actor import HeadActor, model_id_of_head
from cluster.serving.head_messages import AddReply, decode_poll_reply, detached
from cluster.serving.start_errors import EngineStartError
from engine.client.core_client import EngineCoreClient, OnDead, OnStep
from engine.client.core_messages import (
    AddRequest,
    AddResult,
    ControlReply,
    CoreStats,
    decode_steps,
)
from engine.config import EngineConfig
from engine.errors import EngineDeadError

logger = logging.getLogger("llm_cluster.head")

# Threads for the actor's methods: the outstanding poll, adds, aborts, health and stats.
_MAX_CONCURRENCY = 32
_HEALTH_TIMEOUT_S = 20.0

_ADD_REPLY_DECODER = msgspec.msgpack.Decoder(AddReply)
_STATS_DECODER = msgspec.msgpack.Decoder(CoreStats)
_CONTROL_DECODER = msgspec.msgpack.Decoder(ControlReply)
_ENCODER = msgspec.msgpack.Encoder()


def head_actor_resources(bundle: dict[str, float]) -> dict[str, float]:
    """The head actor's Ray resources: all of its bundle's CPUs and devices, so with TP = PP =
    1 exactly the bundle's share of a GPU (``{"GPU": 0.49}`` asks for ``num_gpus=0.49``)."""
    return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}


class HeadCoreClient(EngineCoreClient):
    """The front's side of a ``HeadActor``: starts it in this replica's placement group (bundle
    ``bundle_index``, holding ``resources``) and returns at once; ``wait_started`` then waits
    until its model is loaded (the front loads its tokenizer meanwhile)."""

    def __init__(
        self,
        config: EngineConfig,
        engine_args: dict[str, Any],
        *,
        name: str,
        bundle_index: int,
        resources: dict[str, float],
        core_process: bool | None = None,
    ) -> None:
        self.config = config
        self.name = name
        options: dict[str, Any] = {
            "name": name,
            "max_concurrency": _MAX_CONCURRENCY,
            **head_actor_resources(resources),
        }
        pg = get_current_placement_group()
        if pg is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_index
            )
        self.actor = (
            ray.remote(HeadActor)
            .options(**options)
            .remote(engine_args, model_id_of_head(name), core_process)
        )
        self._on_step: OnStep | None = None
        self._on_dead: OnDead | None = None
        self._dead: EngineDeadError | None = None
        self._poller: asyncio.Task[None] | None = None
        self._acked = 0  # the last step number handed to on_step
        self._shut_down = False

    def wait_started(self) -> None:
        """Block until the head's model is loaded. A head that failed to start is stopped and
        its reason raised (``EngineStartError``; ``RuntimeError`` for a head that died)."""
        try:
            # No deadline: the head's executor bounds each start-up phase itself
            # (LLM_CLUSTER_LOAD_TIMEOUT_S) and a head that dies raises here at once.
            start_failure = ray.get(self.actor.ready.remote())
        except RayError as exc:
            self.shutdown()
            # The head's own error (a bad config, a worker that failed to start) is the cause.
            raise RuntimeError(f"the engine head {self.name} failed to start: {exc}") from exc
        if start_failure is not None:
            self.shutdown()
            raise EngineStartError(start_failure)

    def start(self, on_step: OnStep, on_dead: OnDead) -> None:
        self._on_step, self._on_dead = on_step, on_dead

    @property
    def acked_steps(self) -> int:
        """The number of the last head step handed to ``on_step``."""
        return self._acked

    async def add_request(self, request: AddRequest) -> AddResult:
        self._ensure_poller()
        try:
            data = await detached(self.actor.add_request.remote, _ENCODER.encode(request))
        except TaskCancelledError:
            raise asyncio.CancelledError from None
        except RayError as exc:
            raise self._lost(exc) from exc
        reply = _ADD_REPLY_DECODER.decode(data)
        if reply.error is not None:
            raise reply.error.exception()
        assert reply.result is not None
        return reply.result

    def abort(self, request_ids: list[str]) -> None:
        if self._dead is None:
            detached(self.actor.abort.remote, request_ids)

    async def wait_sink_acked(self, sink: str, wait_s: float) -> bool:
        """``HeadActor.wait_sink_acked``; False if it timed out or the head is gone."""
        if self._dead is not None:
            return False
        try:
            return await detached(self.actor.wait_sink_acked.remote, sink, wait_s)
        except RayError:
            return False

    async def stats(self) -> CoreStats:
        return _STATS_DECODER.decode(await self._call(self.actor.stats))

    async def request_state(self) -> dict[str, Any]:
        return msgspec.msgpack.decode(await self._call(self.actor.request_state))

    async def control(self, name: str, args: tuple[Any, ...] = ()) -> Any:
        if self._dead is not None:
            raise self._dead
        try:
            data = await detached(self.actor.control.remote, name, list(args))
        except RayError as exc:
            raise self._lost(exc) from exc
        reply = _CONTROL_DECODER.decode(data)
        if reply.error is not None:
            raise reply.error.exception()
        return reply.value

    async def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        try:
            problem = await asyncio.wait_for(self._call(self.actor.check_health), _HEALTH_TIMEOUT_S)
        except TimeoutError as exc:
            raise EngineDeadError(
                f"the engine head did not answer in {_HEALTH_TIMEOUT_S:.0f} s"
            ) from exc
        if problem is not None:
            raise EngineDeadError(problem)

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._shut_down or not ray.is_initialized():
            # Once only; and never after Ray is gone: a Ray call would start a new local Ray
            # (an ``LLMServer.__del__`` run by the garbage collector after ``ray.shutdown``).
            return
        self._shut_down = True
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone, or Ray is shutting down: nothing left to stop
            logger.debug("head actor %s: kill failed", self.name, exc_info=True)

    # ---- internals ----------------------------------------------------------------------

    async def _call(self, method: Any) -> Any:
        if self._dead is not None:
            raise self._dead
        try:
            return await detached(method.remote)
        except RayError as exc:
            raise self._lost(exc) from exc

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            if self._dead is not None:
                raise self._dead
            loop = asyncio.get_running_loop()
            self._poller = detached(loop.create_task, self._poll_forever())

    async def _poll_forever(self) -> None:
        while self._dead is None:
            try:
                reply = decode_poll_reply(await self.actor.poll.remote(self._acked))
            except TaskCancelledError:
                continue  # not the head's failure: ask again (nothing unacknowledged is lost)
            except RayError as exc:
                self._lost(exc)
                return
            steps = decode_steps(reply.steps)
            first_seq = reply.last_seq - len(steps) + 1
            for seq, step in enumerate(steps, start=first_seq):
                if seq > self._acked and self._on_step is not None:
                    self._on_step(step)
            self._acked = max(self._acked, reply.last_seq)
            if reply.dead is not None:
                self._fail(EngineDeadError(reply.dead))

    def _lost(self, exc: BaseException) -> EngineDeadError:
        logger.error("engine head %s is gone: %s", self.name, exc)
        return self._fail(EngineDeadError("the engine head process is gone"))

    def _fail(self, error: EngineDeadError) -> EngineDeadError:
        if self._dead is None:
            self._dead = error
            if self._on_dead is not None:
                self._on_dead(error)
        return self._dead


__all__ = ["HeadCoreClient"]
