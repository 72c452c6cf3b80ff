"""The scheduler's waiting queue, by ``scheduling_policy``: FCFS (a deque; preempted requests
go back to the front) or priority (a heap on the request's sort key, arrival breaking ties).
And the caps that bound what waits (``max_waiting_requests``, ``max_waiting_tokens``), which the
engine checks before it enqueues a request (``check_waiting_caps``), and what a request's
``priority`` may be (``check_priority``).
"""

from __future__ import annotations

import heapq
import itertools
import numbers
from collections import deque
from collections.abc import Callable, Iterator

from engine.config_sections import SchedulerConfig
from engine.core.request import Request
from engine.errors import EngineOverloadedError, InvalidRequestError

PRIORITY_RANGE = (-(2**63), 2**63 - 1)  # vLLM's: an int64


class WaitingQueue:
    """FCFS: a deque (preempted requests go back to the front). Priority: a heap on the sort key."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple[float, ...], int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        if self.policy == "fcfs":
            return iter(self._fifo)
        return (entry[2] for entry in sorted(self._heap))

    def add(self, request: Request, *, front: bool = False) -> None:
        if self.policy == "fcfs":
            if front:
                self._fifo.appendleft(request)
            else:
                self._fifo.append(request)
        else:
            heapq.heappush(self._heap, (request.sort_key("priority"), next(self._counter), request))

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][2]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.remove(request)
        else:
            self._heap = [e for e in self._heap if e[2] is not request]
            heapq.heapify(self._heap)


def check_waiting_caps(
    config: SchedulerConfig,
    waiting_load: Callable[[], tuple[int, int]],
    num_prompt_tokens: int,
    n: int,
) -> None:
    """Bounded waiting queue: raise ``EngineOverloadedError`` (nothing enqueued) if a request's
    ``n`` samples or ``num_prompt_tokens`` would take the queue past its caps. ``waiting_load``
    is ``Scheduler.waiting_load``, asked only when a cap is set. The engine checks this after
    validation, so an invalid request is a 400 even under overload."""
    if config.max_waiting_requests is None and config.max_waiting_tokens is None:
        return
    requests, tokens = waiting_load()
    if requests == 0:
        return
    cap = config.max_waiting_requests
    if cap is not None and requests + n > cap:
        raise EngineOverloadedError(
            f"{requests} requests are waiting (max_waiting_requests {cap}); retry later"
        )
    cap = config.max_waiting_tokens
    if cap is not None and tokens + num_prompt_tokens > cap:
        raise EngineOverloadedError(
            f"{tokens} prompt tokens are waiting (max_waiting_tokens {cap}); retry later"
        )


def check_priority(priority: object) -> None:
    """A request's ``priority`` (lower is served first under the priority policy, ignored under
    FCFS, as in vLLM): an integer in int64, checked before anything is enqueued (a string would
    otherwise reach the heap and fail every step's ordering); numpy's integers too."""
    low, high = PRIORITY_RANGE
    integral = isinstance(priority, numbers.Integral) and not isinstance(priority, bool)
    if not integral or not low <= priority <= high:  # type: ignore[operator]
        raise InvalidRequestError(
            f"must be an integer in [-2**63, 2**63 - 1], got {priority!r}", param="priority"
        )
