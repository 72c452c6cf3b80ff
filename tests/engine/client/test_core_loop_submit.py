"""``EngineCoreLoop.submit`` when the core thread dies between the caller's liveness check and
its command's put: the command must fail with the loop's error, never wait forever (the loop's
last drain of its queue ran before the put)."""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest

from engine import LLM
from engine.client.core_loop import EngineCoreLoop
from engine.errors import EngineDeadError


class _DiesBeforePut:
    """The loop's queue: the first put lands after the core thread died and drained it."""

    def __init__(self, loop: EngineCoreLoop, inner: queue.SimpleQueue[Any]) -> None:
        self.loop, self.inner = loop, inner

    def put(self, item: Any) -> None:
        if item is not None:  # the caller's command (None: shutdown's own sentinel)
            self.loop.shutdown()  # the core thread stops, fails what is queued, and is gone
            assert self.loop._dead is not None
        self.inner.put(item)

    def get_nowait(self) -> Any:
        return self.inner.get_nowait()


def test_a_command_put_after_the_loop_died_fails_with_its_error() -> None:
    llm = LLM("builtin:tiny-llama", num_kv_blocks=16, max_model_len=64, device="cpu")
    dead = threading.Event()
    loop = EngineCoreLoop(llm.llm_engine, on_step=lambda _: None, on_dead=lambda _: dead.set())
    loop._commands = _DiesBeforePut(loop, loop._commands)  # type: ignore[assignment]
    future = loop.submit(lambda: "ran")
    assert dead.is_set()
    with pytest.raises(EngineDeadError):
        future.result(timeout=5)
