"""Cumulative wall-clock time per phase of the step, for profiling where a step's time goes.

Always on: one ``perf_counter`` per phase boundary is noise next to a forward pass.

On a GPU, kernels run asynchronously, so by default a phase measures the host's time to
*launch* its work; the device time then lands in the phase that first waits for a result
(the sampled tokens' ``.tolist()``, in "sample"). That costs nothing: the step's one natural
sync is that ``.tolist()``. For a breakdown of device time per phase, turn on device syncs:
``LLM_CLUSTER_STEP_PROFILE=1`` (read when the timer is made, see ``engine.envs``) or
``StepTimer.device_sync = True`` (``Worker.reset_step_timings(device_sync=True)``); each lap
then synchronizes the device before reading the clock, 3-4 syncs per step, which serializes
host and device and lowers throughput. On CPU there is nothing to sync.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch

from engine import envs

__all__ = ["StepTimer", "device_synchronizer"]


def device_synchronizer(device: torch.device) -> Callable[[], None] | None:
    """The call that waits for ``device``'s queued work, or None where there is none (CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


class StepTimer:
    def __init__(
        self, *, sync: Callable[[], None] | None = None, device_sync: bool | None = None
    ) -> None:
        """``sync``: waits for the device (None on CPU). ``device_sync``: whether laps call it;
        None reads ``LLM_CLUSTER_STEP_PROFILE``."""
        self.sync = sync
        self.device_sync = envs.step_profile() if device_sync is None else device_sync
        self.totals: defaultdict[str, float] = defaultdict(float)
        self._last = time.perf_counter()

    @property
    def syncs_device(self) -> bool:
        """Whether phases include the device time of the work they queued."""
        return self.device_sync and self.sync is not None

    def start(self) -> None:
        if self.syncs_device:
            self.sync()
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Add the time since the previous lap (or ``start``) to ``phase``."""
        if self.syncs_device:
            self.sync()
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now

    def reset(self) -> None:
        self.totals.clear()
        self._last = time.perf_counter()
