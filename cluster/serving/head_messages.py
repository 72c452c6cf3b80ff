"""How a ``HeadActor`` (``cluster.serving.head_actor``) is called: its replies, with the one error
table of its calls, and ``detached``, the context every call to it is made in. A module of its
own, free of torch (it needs only the engine's message types), so that the ingress's token
channel can read the head's frames (``PollReply``) without importing the engine core."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TypeVar

import msgspec

from engine.client.core_messages import AddReply, CoreError


class PollReply(msgspec.Struct, array_like=True):
    steps: bytes  # encode_steps(...): decoded only by the front's fan-out
    last_seq: int  # the number of the last step in ``steps`` (the next poll's ``acked``)
    dead: str | None = None
    # Pushed frames only: the ingress acknowledges ``last_seq`` (a drain waits for that).
    ack: bool = False


_POLL_DECODER = msgspec.msgpack.Decoder(PollReply)


def decode_poll_reply(data: bytes) -> PollReply:
    return _POLL_DECODER.decode(data)


T = TypeVar("T")


def detached(fn: Callable[..., T], *args: object) -> T:
    """Call ``fn`` in an empty context: a Ray call made there (or a task created there, such as
    a poller) belongs to no request, so Serve cancelling a request never cancels it."""
    return contextvars.Context().run(fn, *args)


__all__ = ["AddReply", "CoreError", "PollReply", "decode_poll_reply", "detached"]
