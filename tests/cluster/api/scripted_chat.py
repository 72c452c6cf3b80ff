"""A chat response built from a scripted server stream, for the tests of the response builder
(``cluster.api.openai_responses.Completion``) that need no engine."""

from __future__ import annotations

from typing import Any

from cluster.api.openai_payloads import ToolChoice
from cluster.api.openai_responses import Completion
from cluster.api.replica_messages import StreamDelta, StreamStart
from engine.client.core_messages import ChoiceDelta


def scripted_chat(
    start: StreamStart,
    pieces: list[str],
    *,
    stream: bool,
    tools: ToolChoice | None = None,
    finish: str = "stop",
    stop_reason: int | str | None = None,
) -> tuple[Completion, list[dict[str, Any]]]:
    """The response to a stream that opens with ``start`` and whose deltas carry ``pieces``, one
    token each, the last finishing with ``finish`` (the engine's ``stop_reason`` with it); with
    the chunks it produced."""
    completion = Completion("m", True, False, tools=tools, stream=stream)
    chunks = completion.absorb(start)
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = ChoiceDelta(0, piece, [i], None, finish if last else None,
                            stop_reason if last else None, i + 1)  # fmt: skip
        chunks += completion.absorb(StreamDelta([delta]))
    return completion, chunks
