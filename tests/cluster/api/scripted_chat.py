"""A chat response built from a scripted server stream, for the tests of the response builder
(``cluster.api.openai_responses.Completion``) that need no engine."""

from __future__ import annotations

from typing import Any

from cluster.api.openai_payloads import ToolChoice
from cluster.api.openai_responses import Completion
from cluster.api.replica_messages import StreamDelta, StreamStart
from engine.client.core_messages import ChoiceDelta


def scripted_chat(
    start: StreamStart, pieces: list[str], *, stream: bool, tools: ToolChoice | None = None
) -> tuple[Completion, list[dict[str, Any]]]:
    """The response to a stream that opens with ``start`` and whose deltas carry ``pieces``, one
    token each, the last finishing with ``stop``; with the chunks it produced."""
    completion = Completion("m", True, False, tools=tools, stream=stream)
    chunks = completion.absorb(start)
    for i, piece in enumerate(pieces):
        finish = "stop" if i == len(pieces) - 1 else None
        delta = ChoiceDelta(0, piece, [i], None, finish, None, i + 1)
        chunks += completion.absorb(StreamDelta([delta]))
    return completion, chunks
