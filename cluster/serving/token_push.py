"""The token channel's push transport: each head connects to its ingress over TCP and writes
every step's deltas for that ingress as one frame, instead of the ingress polling the head
with a Ray actor call per step.

    HeadActor (core thread appends a step      ingress replica (``TokenListener``, on its
    to the sink's outbox)                      event loop)
    ──────────────────────────────────────     ─────────────────────────────────────────
    SinkPusher writer thread ── connect ─────▶ accept
                             ── Hello(token, head) ─▶ checks the token (the sink's secret)
                             ── PollReply(steps, last_seq, dead) ─▶ dispatches the deltas
    SinkPusher reader thread ◀── acked (last_seq) ──── one ack per frame

A Ray actor call costs ~0.5 ms of CPU in the caller and the callee and wakes the head's main
thread, which takes the GIL from its core thread; a frame on a socket costs tens of
microseconds (BENCHMARKS.md, "The token channel pushed"). Frames are length-prefixed msgpack
(``PollReply``, the poll's reply, so both transports carry the same message); nothing is
pickled. Steps stay in the head's outbox until acknowledged, as with polling, so a drain
(``HeadActor.wait_sink_acked``) still waits for the ingress to have them.

The sink names the listener: ``tcp://HOST:PORT/TOKEN``. The token is a random secret that
travels only inside Ray's own calls (the ``GenerateRequest``), so nothing that merely reaches
the port can inject tokens into a stream. A connection lives as long as both ends: the ingress
that sees it end fails the streams still open on that head (503), the head that sees it end
drops the sink (its ingress is gone; Serve cancels those requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from cluster.serving.head_messages import PollReply
from engine.core_messages import encode_steps

logger = logging.getLogger("llm_cluster.token_push")

SCHEME = "tcp://"
_LEN = struct.Struct("!I")
_MAX_FRAME = 1 << 30
_CONNECT_TIMEOUT_S = 10.0


class Hello(msgspec.Struct, array_like=True):
    token: str
    head: str


_HELLO_DECODER = msgspec.msgpack.Decoder(Hello)
_REPLY_DECODER = msgspec.msgpack.Decoder(PollReply)
_INT_DECODER = msgspec.msgpack.Decoder(int)
_ENCODER = msgspec.msgpack.Encoder()


def is_push_sink(sink: str) -> bool:
    return sink.startswith(SCHEME)


def parse_sink(sink: str) -> tuple[str, int, str]:
    """``tcp://HOST:PORT/TOKEN`` -> (host, port, token); ValueError naming the sink if malformed."""
    address, _, token = sink.removeprefix(SCHEME).partition("/")
    host, _, port = address.rpartition(":")
    if not sink.startswith(SCHEME) or not host or not port.isdigit() or not token:
        raise ValueError(f"sink {sink!r} is not tcp://HOST:PORT/TOKEN")
    return host.strip("[]"), int(port), token


def frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("the ingress closed the token channel")
        chunks += chunk
    return bytes(chunks)


# ---- the head's side (threads) ------------------------------------------------------------


class SinkPusher:
    """Writes one sink's outbox to its ingress. ``outbox`` is the head's ``_Outbox`` (``steps``,
    ``first_seq``, ``ack``) guarded by ``lock``, a Condition the head notifies whenever it
    appends a step or dies; ``dead()`` is the head's reason, or None. ``on_broken`` runs (outside
    the lock) once the connection fails or ends."""

    def __init__(
        self,
        sink: str,
        head: str,
        outbox: Any,
        lock: threading.Condition,
        dead: Callable[[], str | None],
        on_broken: Callable[[str], None],
    ) -> None:
        self.sink = sink
        self._head = head
        self._outbox = outbox
        self._lock = lock
        self._dead = dead
        self._on_broken = on_broken
        self._closed = False
        self._sock: socket.socket | None = None
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name="token-push-writer")  # fmt: skip
        self._writer.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _write_loop(self) -> None:
        try:
            host, port, token = parse_sink(self.sink)
            sock = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            sock.sendall(frame(_ENCODER.encode(Hello(token, self._head))))
            threading.Thread(target=self._read_acks, args=(sock,), daemon=True,
                             name="token-push-acks").start()  # fmt: skip
            sent = 0  # the last step number written
            while (message := self._next_frame(sent)) is not None:
                payload, sent, dead = message
                sock.sendall(payload)
                if dead is not None:
                    return
        except (OSError, ValueError) as exc:
            if not self._closed:
                logger.warning("token channel to %s ended: %s", self.sink.rpartition("/")[0], exc)
        finally:
            self.close()
            if self._sock is not None:
                self._sock.close()
            self._on_broken(self.sink)

    def _next_frame(self, sent: int) -> tuple[bytes, int, str | None] | None:
        """Waits for steps after ``sent`` (or the head's death): the frame, its last step's
        number and the death it reports; None once closed."""
        box = self._outbox
        with self._lock:
            self._lock.wait_for(
                lambda: self._closed or self._dead() is not None
                or box.first_seq + len(box.steps) - 1 > sent
            )  # fmt: skip
            if self._closed:
                return None
            last_seq = box.first_seq + len(box.steps) - 1
            unsent = box.steps[max(0, sent + 1 - box.first_seq) :]
            dead = self._dead()
        reply = PollReply(encode_steps(unsent), last_seq, dead)
        return frame(_ENCODER.encode(reply)), last_seq, dead

    def _read_acks(self, sock: socket.socket) -> None:
        try:
            while True:
                (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
                acked = _INT_DECODER.decode(_recv_exact(sock, size))
                with self._lock:
                    self._outbox.ack(acked)
                    self._lock.notify_all()  # a drain's wait_sink_acked
        except (OSError, ValueError, msgspec.DecodeError):
            self.close()


# ---- the ingress's side (its event loop) --------------------------------------------------


class TokenListener:
    """Accepts the heads' connections on one port for one ingress. ``on_steps(head, reply)``
    gets each frame (a ``PollReply``); ``on_lost(head)`` runs once a head's connection ends."""

    def __init__(
        self,
        on_steps: Callable[[str, PollReply], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self._on_steps = on_steps
        self._on_lost = on_lost
        self._token = secrets.token_hex(16)
        self._server: asyncio.Server | None = None
        self.sink: str | None = None

    async def start(self, host: str) -> str:
        """Listen on every interface; the sink names ``host`` (this node's address)."""
        self._server = await asyncio.start_server(self._serve, host="0.0.0.0", port=0)
        port = self._server.sockets[0].getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self.sink = f"{SCHEME}{shown}:{port}/{self._token}"
        return self.sink

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head: str | None = None
        try:
            hello = _HELLO_DECODER.decode(await _read_frame(reader))
            if not hmac.compare_digest(hello.token, self._token):
                logger.warning("token channel: a connection with a wrong token, closed")
                return
            head = hello.head
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                reply = _REPLY_DECODER.decode(await _read_frame(reader))
                self._on_steps(head, reply)
                writer.write(frame(_ENCODER.encode(reply.last_seq)))
                if reply.dead is not None:
                    return
        except (OSError, asyncio.IncompleteReadError, ValueError, msgspec.DecodeError):
            pass
        finally:
            writer.close()
            if head is not None:
                self._on_lost(head)


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > _MAX_FRAME:
        raise ValueError(f"token channel frame of {size} bytes")
    return await reader.readexactly(size)


__all__ = ["Hello", "SinkPusher", "TokenListener", "frame", "is_push_sink", "parse_sink"]
