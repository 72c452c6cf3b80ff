"""A chat response built from a scripted server stream, for the tests of the response builder
(``cluster.api.openai_responses.Completion``) that need no engine."""

from __future__ import annotations

from typing import Any

from cluster.api.openai_payloads import ToolChoice
from cluster.api.openai_responses import Completion
from cluster.api.replica_messages import StreamDelta, StreamStart
from engine.client.core_messages import ChoiceDelta
from engine.outputs import Logprob


def scripted_chat(
    start: StreamStart,
    pieces: list[str],
    *,
    stream: bool,
    tools: ToolChoice | None = None,
    finish: str = "stop",
    stop_reason: int | str | None = None,
    logprobs: bool = False,
    include_reasoning: bool = True,
) -> tuple[Completion, list[dict[str, Any]]]:
    """The response to a stream that opens with ``start`` and whose deltas carry ``pieces``, one
    token each, the last finishing with ``finish`` (the engine's ``stop_reason`` with it); with
    the chunks it produced. ``logprobs``: the request asked for them (no alternatives), and
    token i has logprob ``-i``."""
    completion = Completion("m", True, False, 0 if logprobs else None, tools=tools,
                            stream=stream, include_reasoning=include_reasoning)  # fmt: skip
    chunks = completion.absorb(start)
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        entries = [{i: Logprob(-float(i), 1, piece)}] if logprobs else None
        delta = ChoiceDelta(0, piece, [i], entries, finish if last else None,
                            stop_reason if last else None, i + 1)  # fmt: skip
        chunks += completion.absorb(StreamDelta([delta]))
    return completion, chunks
