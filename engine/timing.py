"""Cumulative wall-clock time per phase of the step, for profiling where a step's time goes.

Always on: one ``perf_counter`` per phase boundary is noise next to a forward pass. On CUDA the
clock synchronizes before reading so that asynchronous kernels count in the phase that queued them.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class StepTimer:
    def __init__(self, *, sync_cuda: bool = False) -> None:
        self.sync_cuda = sync_cuda
        self.totals: defaultdict[str, float] = defaultdict(float)
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Add the time since the previous lap (or ``start``) to ``phase``."""
        if self.sync_cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now

    def reset(self) -> None:
        self.totals.clear()
        self._last = time.perf_counter()
