"""``OpenAIIngress.open_streams`` (a completions request of several prompts) without Ray: the
client leaving while some prompts are open and others still opening ends the open ones (their
token-channel queues released, their replica calls cancelled), as a failed prompt does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.serving.ingress import OpenAIIngress


class _Stream:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _Ingress:
    open_streams = OpenAIIngress.open_streams

    def __init__(self) -> None:
        self.streams: list[_Stream] = []

    async def open_stream(self, model: str, payload: Any) -> tuple[Any, _Stream]:
        if payload == "slow":  # waits for its replica (Serve's queue)
            await asyncio.sleep(60)
        if payload == "bad":
            raise ValueError("refused")
        stream = _Stream()
        self.streams.append(stream)
        return object(), stream


def test_a_client_leaving_while_prompts_open_ends_those_already_open() -> None:
    ingress = _Ingress()

    async def run() -> None:
        opening = asyncio.ensure_future(ingress.open_streams("m", ["fast", "slow", "fast"]))
        while len(ingress.streams) < 2:
            await asyncio.sleep(0)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening

    asyncio.run(run())
    assert [s.cancelled for s in ingress.streams] == [True, True]


def test_a_prompt_refused_ends_the_others() -> None:
    ingress = _Ingress()
    with pytest.raises(ValueError, match="refused"):
        asyncio.run(ingress.open_streams("m", ["fast", "bad", "fast"]))
    assert [s.cancelled for s in ingress.streams] == [True, True]
