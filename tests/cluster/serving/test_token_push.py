"""The token channel's push transport (``cluster.serving.token_push``) on its own: a head's
``SinkPusher`` writing to an ingress's ``TokenListener`` over a real TCP connection."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from cluster.serving.head_messages import PollReply
from cluster.serving.token_push import SinkPusher, TokenListener, parse_sink
from engine.client.core_messages import ChoiceDelta, RequestDelta, StepOutputs, decode_steps
from engine.outputs import Logprob


class _Outbox:
    """The head's outbox (``head_actor._Outbox``): steps numbered from ``first_seq``."""

    def __init__(self) -> None:
        self.steps: list[StepOutputs] = []
        self.first_seq = 1

    def ack(self, acked: int) -> None:
        drop = max(0, min(acked - self.first_seq + 1, len(self.steps)))
        del self.steps[:drop]
        self.first_seq += drop


def _step(request_id: str, number: int) -> StepOutputs:
    delta = RequestDelta(request_id=request_id, choices=[], finished=False)
    return StepOutputs([delta], float(number))


class _Head:
    def __init__(self, sink: str) -> None:
        self.lock = threading.Condition()
        self.box = _Outbox()
        self.dead: str | None = None
        self.broken = threading.Event()
        self.pusher = SinkPusher(sink, "LLMHead:m:1", self.box, self.lock, lambda: self.dead,
                                 lambda _sink: self.broken.set())  # fmt: skip

    def push(self, step: StepOutputs) -> None:
        with self.lock:
            self.box.steps.append(step)
            self.pusher.pushed()

    def die(self, why: str) -> None:
        with self.lock:
            self.dead = why
            self.pusher.pushed()

    def synced(self) -> bool:
        with self.lock:
            return self.pusher.synced()


async def _until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)


def test_steps_arrive_once_each_in_order_and_are_acknowledged_on_request() -> None:
    received: list[tuple[str, float]] = []
    lost: list[str] = []

    def on_steps(head: str, reply: PollReply) -> None:
        received.extend((head, step.time) for step in decode_steps(reply.steps))

    async def run() -> _Head:
        listener = TokenListener(on_steps, lost.append)
        sink = await listener.start("127.0.0.1")
        head = _Head(sink)
        for number in range(1, 201):  # the writer batches whatever piled up: none twice
            head.push(_step("r", number))
            if number % 50 == 0:
                await asyncio.sleep(0.02)
        await _until(lambda: len(received) >= 200)
        assert not head.box.steps  # written steps leave the outbox
        assert not head.synced()  # no frame asked for an acknowledgement
        with head.lock:
            head.pusher.request_ack()  # what a drain does
        await _until(head.synced)
        head.pusher.close()
        await _until(lambda: bool(lost))
        listener.close()
        return head

    head = asyncio.run(asyncio.wait_for(run(), 30))
    assert received == [("LLMHead:m:1", float(n)) for n in range(1, 201)]
    assert lost == ["LLMHead:m:1"] and head.broken.wait(5)


def test_a_delta_arrives_with_the_engines_logprob_types() -> None:
    """The ingress renders OpenAI rows from what arrives: int token ids, ``Logprob``s, in the
    engine's order (the sampled token first)."""
    logprobs = [{9: Logprob(-2.0, 3, "z"), 4: Logprob(-0.1, 1, "a")}]
    choice = ChoiceDelta(0, "z", [9], logprobs, "stop", None, 1, -2.0)
    sent = StepOutputs([RequestDelta("r", [choice], True)], 1.0)
    received: list[StepOutputs] = []

    async def run() -> None:
        listener = TokenListener(lambda _h, reply: received.extend(decode_steps(reply.steps)),
                                 lambda _head: None)  # fmt: skip
        head = _Head(await listener.start("127.0.0.1"))
        head.push(sent)
        await _until(lambda: bool(received))
        head.pusher.close()
        listener.close()

    asyncio.run(asyncio.wait_for(run(), 30))
    (entry,) = received[0].deltas[0].choices[0].logprobs or []
    assert list(entry.items()) == [(9, Logprob(-2.0, 3, "z")), (4, Logprob(-0.1, 1, "a"))]
    assert received == [sent]


def test_a_dead_head_says_why_in_its_last_frame() -> None:
    replies: list[PollReply] = []
    lost: list[str] = []

    async def run() -> None:
        listener = TokenListener(lambda _head, reply: replies.append(reply), lost.append)
        head = _Head(await listener.start("127.0.0.1"))
        head.push(_step("r", 1))
        await _until(lambda: bool(replies))
        head.die("the engine failed: boom")
        await _until(lambda: bool(lost))
        listener.close()

    asyncio.run(asyncio.wait_for(run(), 30))
    assert replies[-1].dead == "the engine failed: boom"
    assert lost == ["LLMHead:m:1"]


def test_a_connection_without_the_sinks_token_delivers_nothing() -> None:
    received: list[PollReply] = []
    lost: list[str] = []

    async def run() -> _Head:
        listener = TokenListener(lambda _head, reply: received.append(reply), lost.append)
        sink = await listener.start("127.0.0.1")
        host, port, _token = parse_sink(sink)
        head = _Head(f"tcp://{host}:{port}/{'0' * 32}")
        head.push(_step("r", 1))
        await asyncio.to_thread(head.broken.wait, 10)  # the listener hung up on it
        listener.close()
        return head

    head = asyncio.run(asyncio.wait_for(run(), 30))
    assert head.broken.is_set() and not received and not lost


@pytest.mark.parametrize("sink", ["ingress-abc", "tcp://:80/x", "tcp://h:port/x", "tcp://h:1/"])
def test_a_malformed_sink_is_named(sink: str) -> None:
    with pytest.raises(ValueError, match="tcp://HOST:PORT/TOKEN"):
        parse_sink(sink)


def test_a_channel_ends_every_open_stream_from_another_thread() -> None:
    """The ingress's SIGTERM hook runs on the worker's main thread, not the event loop."""
    from cluster.api.replica_messages import unavailable
    from cluster.serving.token_channel import TokenChannel

    async def run() -> list[Any]:
        channel = TokenChannel()
        await channel.sink()  # serving: the channel knows its loop
        channel.register("a")
        channel.register("b")
        queues = [channel._queues["a"], channel._queues["b"]]
        error = unavailable("the server is stopping; retry")
        await asyncio.to_thread(channel.end_all_threadsafe, error)
        return [await asyncio.wait_for(q.get(), 5) for q in queues]

    ended = asyncio.run(run())
    assert [(e.status, e.message) for e in ended] == [(503, "the server is stopping; retry")] * 2


def test_a_push_never_blocks_on_an_ingress_that_stops_reading() -> None:
    """The core thread writes each step itself; when the socket would block (the ingress reads
    slower than the engine makes tokens), the writer thread takes over: pushing stays fast and
    every step still arrives, in order, once the ingress reads again."""
    received: list[float] = []
    lost: list[str] = []
    payload = "x" * 20_000  # ~20 KB a step: 3,000 steps (60 MB) outgrow the socket buffers

    def on_steps(_head: str, reply: PollReply) -> None:
        received.extend(step.time for step in decode_steps(reply.steps))

    async def run() -> tuple[_Head, float]:
        listener = TokenListener(on_steps, lost.append)
        head = _Head(await listener.start("127.0.0.1"))
        head.push(_step(payload, 0))
        await _until(lambda: bool(received))  # connected, the core thread writes from now on

        def push_all() -> float:  # while the ingress's loop is not reading at all
            slowest = 0.0
            for number in range(1, 3001):
                started = time.perf_counter()
                head.push(_step(payload, number))
                slowest = max(slowest, time.perf_counter() - started)
            return slowest

        slowest = push_all()  # runs on the loop's thread: nothing reads meanwhile
        await _until(lambda: len(received) >= 3001, 30)
        head.pusher.close()
        await _until(lambda: bool(lost))
        listener.close()
        return head, slowest

    head, slowest = asyncio.run(asyncio.wait_for(run(), 60))
    assert received == [float(n) for n in range(3001)]
    assert slowest < 0.5, f"a push blocked for {slowest:.2f} s"
    assert head.broken.wait(5)
