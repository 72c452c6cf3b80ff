"""The scheduler's waiting queue, by ``scheduling_policy``: FCFS (a deque; preempted requests
go back to the front) or priority (a heap on the request's sort key, arrival breaking ties).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from engine.core.request import Request


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
