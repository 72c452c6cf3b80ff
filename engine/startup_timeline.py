"""Where a start goes: wall-clock marks of one process's start-up, logged once as one line.

Each process of a serving start (the ``cluster serve`` driver, a model replica, its engine
head, a worker) keeps a ``StartupTimeline``: a mark when a phase ends, named for that phase,
as epoch seconds, so marks of processes on one machine line up on one clock. ``log`` writes
them once, at INFO, in one line that reads as durations and carries the epochs for scripts:

    start-up timeline of head bench: imports 3.41 s, config 0.05 s, ... | epochs process
    start=1764940001.120 imports=1764940004.530 ...                              (one line)

``parse_timelines`` reads such lines back (``benchmarks/cold_start.py`` puts every process's
marks on one timeline). The first mark, where there is one, is the process's own start time
(``/proc/self/stat``), so the first phase is the process's start and its imports. Always on:
a handful of ``time.time()`` calls per start.
"""

from __future__ import annotations

import logging
import os
import re
import time

__all__ = ["StartupTimeline", "parse_timelines", "process_start_time"]

_PREFIX = "start-up timeline of "
_LINE = re.compile(_PREFIX + r"(?P<who>.+?): .* \| epochs (?P<epochs>.*)$")
_EPOCH = re.compile(r"(?P<name>[^=]+?)=(?P<at>\d+\.\d+)(?: |$)")


def process_start_time() -> float | None:
    """This process's start as epoch seconds (Linux: ``/proc/self/stat`` and the boot time),
    or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        ticks = int(fields[19])  # starttime: field 22, clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class StartupTimeline:
    """Marks of one process's start-up (``who`` names the process: ``head bench``)."""

    def __init__(self, who: str, *, from_process_start: bool = False) -> None:
        """``from_process_start``: the first mark is the process's start (``process start``)."""
        self.who = who
        self.marks: list[tuple[str, float]] = []
        self._logged = False
        started = process_start_time() if from_process_start else None
        if started is not None:
            self.marks.append(("process start", started))

    def mark(self, phase: str) -> None:
        """``phase`` ended now (nothing once the line is logged: a wake is no start)."""
        if not self._logged:
            self.marks.append((phase, time.time()))

    def durations(self) -> list[tuple[str, float]]:
        """(phase, seconds) from each mark to the next, named by the later mark."""
        return [(b[0], b[1] - a[1]) for a, b in zip(self.marks, self.marks[1:], strict=False)]

    def line(self) -> str:
        phases = ", ".join(f"{name} {s:.2f} s" for name, s in self.durations())
        epochs = " ".join(f"{name}={at:.3f}" for name, at in self.marks)
        return f"{_PREFIX}{self.who}: {phases or 'no phases'} | epochs {epochs}"

    def log(self, logger: logging.Logger) -> None:
        """Log the line once (a later call, e.g. on a wake, logs nothing)."""
        if not self._logged:
            self._logged = True
            logger.info("%s", self.line())


def parse_timelines(text: str) -> list[tuple[str, list[tuple[str, float]]]]:
    """Every timeline line in ``text``: (who, [(phase, epoch seconds), ...])."""
    found = []
    for line in text.splitlines():
        match = _LINE.search(line)
        if match:
            marks = [(m["name"], float(m["at"])) for m in _EPOCH.finditer(match["epochs"])]
            found.append((match["who"], marks))
    return found
