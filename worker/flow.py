"""What the worker's threads share besides their messages: the engine's room and the drain."""
from __future__ import annotations

import threading
import time


class Capacity:
    """How many more jobs the engine can start, less those already on their way to it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._free = 0
        self._in_transit = 0

    def publish(self, free_slots: int, received: int = 0) -> None:
        with self._cond:
            self._free = free_slots
            self._in_transit -= received
            if self._free > self._in_transit:
                self._cond.notify_all()

    def wait_for_room(self, timeout: float) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._free > self._in_transit, timeout)
            return max(self._free - self._in_transit, 0)

    def take(self, n: int) -> int:
        """Room for up to `n` jobs now on their way to the engine; returns how many got room. Each source
        of jobs takes its room here, so two sources never fill the same room."""
        with self._cond:
            n = max(min(n, self._free - self._in_transit), 0)
            self._in_transit += n
            return n

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class Drain:
    """Whether the worker has stopped reading jobs, and until when its running jobs may finish."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.deadline: float | None = None  # set when stopping begins: running jobs are handed back past it

    def begin(self, timeout: float, now: bool = False) -> bool:
        """Stop reading; running jobs get `timeout` seconds (none if `now`). Returns True the first time."""
        first = not self.stopping.is_set()
        if first:
            self.deadline = time.monotonic() + timeout
        if now:
            self.deadline = min(self.deadline, time.monotonic())
        self.stopping.set()
        return first

    def overdue(self) -> bool:
        """Stopping, and past the deadline."""
        return self.stopping.is_set() and time.monotonic() >= self.deadline
