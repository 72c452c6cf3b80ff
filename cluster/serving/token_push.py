"""The token channel's transport: each head connects to its ingress over TCP and writes every
step's deltas for that ingress as one frame, with no Ray call per step (BENCHMARKS.md, "The
token channel pushed").

    HeadActor (core thread appends a step      ingress replica (``TokenListener``, on its
    to the sink's outbox)                      event loop)
    ──────────────────────────────────────     ─────────────────────────────────────────
    SinkPusher writer thread ── connect ─────▶ accept
                             ── Hello(token, head) ─▶ checks the token (the sink's secret)
    core thread, each step   ── PollReply(steps, last_seq, dead, ack) ─▶ dispatches the deltas
    SinkPusher reader thread ◀── acked (last_seq) ──── only when the frame asks (a drain)

Frames are length-prefixed msgpack (``PollReply``, the message the replica's front polls from
its head too); nothing is pickled. The sink names the listener: ``tcp://HOST:PORT/TOKEN``.
The token is a random secret that travels only inside Ray's own calls (the
``GenerateRequest``), so nothing that merely reaches the port can inject tokens into a stream.
A connection lives as long as both ends: the ingress that sees it end fails the streams still
open on that head (503), the head that sees it end drops the sink (its ingress is gone; Serve
cancels those requests).
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
from engine.client.core_messages import encode_steps

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


# ---- the head's side -----------------------------------------------------------------------


class SinkPusher:
    """Writes one sink's outbox to its ingress. The core thread writes each step's frame
    itself, without blocking, so no other thread of the head wakes per step (a Ray actor call
    would wake the head's main thread, which takes the GIL from its core thread). A drain
    (``HeadActor.wait_sink_acked``) asks the ingress to acknowledge what it has, and waits.
    ``outbox`` is the head's ``_Outbox`` (``steps``,
    ``first_seq``, ``ack``) guarded by ``lock``, this outbox's Condition; ``dead()`` is the
    head's reason, or None. ``on_broken`` runs (outside the lock) once the connection fails or
    ends.

    The head calls ``pushed()`` holding ``lock`` whenever it appended a step or died. The
    calling thread (the core thread, once per step) writes the unsent steps itself when the
    socket takes the whole frame without blocking: no other thread wakes, so nothing takes the
    GIL from the core thread between its steps (a writer thread woken per step did, and so did
    an ack per frame: BENCHMARKS.md, "The push from the core thread"). The writer thread
    connects, then sleeps; it writes only what would block (the ingress reads slower than the
    engine makes tokens) and the head's last frame, so a slow ingress never stalls the engine.
    A step written to the socket leaves the outbox (TCP delivers it or the connection fails,
    and then its streams fail); ``request_ack`` asks the ingress to confirm what it has, for a
    drain (``synced``)."""

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
        # Guarded by ``lock``: the writer thread owns the socket's writes (connecting, a
        # frame's rest the socket would not take, the last frame); the rest of that frame;
        # the last step number handed to the socket, and the last the ingress acknowledged.
        self._writer_owns = True
        self._rest = b""
        self._sent = 0
        self._acked = 0
        self._want_ack = False
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

    # ---- called by the head, holding ``lock`` --------------------------------------------

    def pushed(self) -> None:
        """Write the unsent steps now if the socket takes them without blocking, else leave
        them to the writer thread. Never blocks."""
        if self._writer_owns or self._closed or self._sock is None:
            self._lock.notify_all()
            return
        if self._dead() is not None:  # the last frame: the writer sends it and hangs up
            self._writer_owns = True
            self._lock.notify_all()
            return
        data = self._frame_locked()
        if data is None:
            return
        try:
            written = self._sock.send(data, socket.MSG_DONTWAIT)
        except OSError:  # would block (BlockingIOError), or broken: the writer's write reports it
            written = 0
        if written < len(data):
            self._rest = data[written:]
            self._writer_owns = True
            self._lock.notify_all()

    def request_ack(self) -> None:
        """Ask the ingress to acknowledge every step written so far (an empty frame if there
        is nothing new to carry the request)."""
        self._want_ack = True
        if self._sock is not None:
            self._writer_owns = True  # rare (a drain): the writer sends it, blocking if need be
        self._lock.notify_all()

    def synced(self) -> bool:
        """Every step of the outbox written, and acknowledged by the ingress."""
        return not self._outbox.steps and not self._rest and self._acked >= self._sent

    def _frame_locked(self, final: bool = False) -> bytes | None:
        """The frame of the steps not yet written (they leave the outbox), or None when there
        are none and nothing else to say."""
        box = self._outbox
        last_seq = box.first_seq + len(box.steps) - 1
        dead = self._dead()
        if last_seq <= self._sent and not self._want_ack and not final:
            return None
        unsent = box.steps[max(0, self._sent + 1 - box.first_seq) :]
        reply = PollReply(encode_steps(unsent), last_seq, dead, self._want_ack or final)
        self._want_ack = False
        self._sent = last_seq
        box.ack(last_seq)
        return frame(_ENCODER.encode(reply))

    # ---- the writer thread ---------------------------------------------------------------

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
            while (message := self._next_write()) is not None:
                data, last = message
                sock.sendall(data)
                if last:
                    return
        except (OSError, ValueError) as exc:
            if not self._closed:
                logger.warning("token channel to %s ended: %s", self.sink.rpartition("/")[0], exc)
        finally:
            self.close()
            if self._sock is not None:
                self._sock.close()
            self._on_broken(self.sink)

    def _next_write(self) -> tuple[bytes, bool] | None:
        """Waits until the writer owns something to write: (the bytes, whether it is the last
        frame); None once closed. Hands writing back to the core thread once all is written."""
        with self._lock:
            while True:
                if self._closed:
                    return None
                if self._writer_owns or self._dead() is not None:
                    if self._rest:
                        data, self._rest = self._rest, b""
                        return data, False
                    dead = self._dead() is not None
                    data = self._frame_locked(final=dead)
                    if data is not None:
                        return data, dead
                    self._writer_owns = False  # all written: the core thread writes again
                self._lock.wait()

    def _read_acks(self, sock: socket.socket) -> None:
        try:
            while True:
                (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
                acked = _INT_DECODER.decode(_recv_exact(sock, size))
                with self._lock:
                    self._acked = max(self._acked, acked)
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
                if reply.ack:
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


__all__ = ["Hello", "SinkPusher", "TokenListener", "frame", "parse_sink"]
