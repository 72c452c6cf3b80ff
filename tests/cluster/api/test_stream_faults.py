"""A fault while a streamed response is being built (a bug in shaping one response) ends that
stream with the API's error event, never with a 200 body that just stops: the chat and
completions SSE (``stream_sse``: an error chunk, then ``[DONE]``) and the Messages API's
(``error`` event). The request's stream is cancelled either way."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from cluster.api.anthropic_builder import MessageBuilder
from cluster.api.openai_responses import Completion, stream_sse
from cluster.serving.ingress_messages import _sse


async def _collect(body: AsyncIterator[bytes]) -> list[str]:
    return [chunk.decode() async for chunk in body]


async def _one_item() -> AsyncIterator[tuple[int, Any]]:
    yield 0, object()


def test_a_chat_stream_that_fails_while_built_ends_with_an_error_and_done() -> None:
    completion = Completion("m", chat=True, include_usage=True)
    closed = []

    def absorb(item: Any, prompt_index: int = 0) -> list[dict[str, Any]]:
        raise RuntimeError("a parser bug")

    completion.absorb = absorb  # type: ignore[method-assign]
    events = asyncio.run(_collect(stream_sse(completion, _one_item(), lambda: closed.append(1))))
    assert events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "APIError" and "failed while building" in error["message"]
    assert closed == [1]


def test_a_messages_stream_that_fails_while_built_ends_with_an_error_event() -> None:
    class _Stream:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    async def events() -> AsyncIterator[dict[str, Any]]:
        yield {"type": "ping"}
        raise KeyError("a builder bug")

    stream = _Stream()
    out = asyncio.run(_collect(_sse(MessageBuilder("m"), events(), stream)))
    assert out[-1].startswith("event: error\n")
    assert json.loads(out[-1].split("data: ", 1)[1])["error"]["type"] == "api_error"
    assert stream.cancelled
