"""An ``AsyncLLMEngine`` dropped without ``shutdown()`` is collected and its core stopped (the
thread that steps it ends, and with it the model and KV cache), as vLLM's ``AsyncLLM``: a loop
that builds engines and drops them (tests, RL) would otherwise keep every one."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

from engine import SamplingParams
from engine.client.async_llm_engine import AsyncLLMEngine

ARGS = {"model": "builtin:tiny-llama", "num_kv_blocks": 16, "max_model_len": 64, "device": "cpu"}


def _core_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "llm-engine-core"]


def test_a_dropped_engine_is_collected_and_its_core_thread_ends() -> None:
    before = len(_core_threads())

    async def use_once() -> weakref.ref[AsyncLLMEngine]:
        engine = AsyncLLMEngine.from_engine_args(**ARGS)
        params = SamplingParams(temperature=0, max_tokens=2)
        async for _ in engine.generate("hi", params, "r1"):
            pass
        return weakref.ref(engine)

    ref = asyncio.run(use_once())
    gc.collect()
    assert ref() is None
    deadline = time.monotonic() + 20
    while len(_core_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_core_threads()) == before
