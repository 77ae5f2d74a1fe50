"""Cache-aware admission (`--cache-aware-admission`): jobs read ahead of the engine's room, and which of them
start when room frees, so that jobs sharing a prompt prefix run while its KV blocks are in the prefix cache.

A job read ahead is pending under this worker like a running one (heartbeated, reclaimed by another worker if
this one dies, handed back when it drains) but not started: its status stays `queued`, so a cancel settles
it at once, and START checks its deadline when it starts. When room frees, `Lookahead.choose` picks:
  1. the highest priority read ahead (the streams' order);
  2. within it, jobs whose deadline falls within `max_wait` seconds, and jobs kept back `max_wait` seconds past
     their turn in arrival order, oldest first. A job's turn comes when as many jobs have started as were read
     ahead before it: that is when arrival order would have started it, so grouping delays a job by about
     max_wait at most, however long the backlog read ahead;
  3. then the job whose prompt has the most leading blocks in the engine's prefix cache, or shared with jobs
     started in the last WARM_S seconds (their blocks are about to be computed); the oldest of equals.
Jobs whose deadline has passed are started at once (START settles them expired), whatever the room.
"""
from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .consumer import Job

LOOKAHEAD_PER_SEQ = 4  # default read-ahead: this many jobs per engine sequence slot (max_num_seqs)
WARM_S = 10.0  # a started job's blocks count as shared this long: from its start to its prefill on a busy engine


@dataclass
class Waiting:
    """A job read ahead, with what choosing it needs."""

    job: Job
    priority: int
    order: int  # arrival here: the oldest of equals first
    deadline_at: float | None  # time.monotonic() of its deadline, from its entry id (Redis's clock)
    hashes: list[int] = field(default_factory=list)  # its prompt's leading block hashes (prefix_block_hashes)
    score: int = 0  # leading blocks cached or shared, as of the last choose
    turn_at: float | None = None  # when arrival order would have started it (time.monotonic())


def entry_deadline(entry_id: str, deadline_s: float | None) -> float | None:
    """A deadline measured from the entry's enqueue (its id's milliseconds), on this process's monotonic clock."""
    if deadline_s is None:
        return None
    enqueued_s = int(entry_id.split("-", 1)[0]) / 1000
    return time.monotonic() + enqueued_s + deadline_s - time.time()


class Lookahead:
    """The jobs read ahead (the reader thread's alone), at most `capacity` of them."""

    def __init__(self, capacity: int, max_wait: float, cached_blocks: Callable[[list[int]], int]) -> None:
        self.capacity, self.max_wait, self.cached_blocks = capacity, max_wait, cached_blocks
        self._waiting: list[Waiting] = []
        self._warm: dict[int, float] = {}  # block hash -> until when it counts as shared
        self._order = 0
        self._turns: deque[Waiting] = deque()  # every job read ahead, in arrival order, until its turn comes

    def __len__(self) -> int:
        return len(self._waiting)

    def space(self) -> int:
        return max(self.capacity - len(self._waiting), 0)

    def add(self, job: Job, hashes: list[int]) -> None:
        self._order += 1
        deadline_at = entry_deadline(job.entry_id, job.spec.deadline_s)
        waiting = Waiting(job, job.spec.priority, self._order, deadline_at, hashes)
        self._waiting.append(waiting)
        self._turns.append(waiting)

    def take_all(self) -> list[Job]:
        jobs = [w.job for w in self._waiting]
        self._waiting, self._turns = [], deque()
        return jobs

    def restore(self, waiting: list[Waiting]) -> None:
        """Put back what due() or choose() took, when starting it failed (Redis unreachable)."""
        self._waiting += waiting

    def due(self) -> tuple[list[Waiting], list[Job]]:
        """(jobs to start now whatever the room: past their deadline, or cancelled while read ahead; jobs
        another worker took over, to forget), both taken out."""
        now = time.monotonic()
        start, lost, keep = [], [], []
        for w in self._waiting:
            if w.job.abort_reason == "lost":
                lost.append(w.job)
            elif w.job.abort_reason is not None or (w.deadline_at is not None and now >= w.deadline_at):
                start.append(w)
            else:
                keep.append(w)
        self._waiting = keep
        return start, lost

    def choose(self, n: int) -> list[Waiting]:
        """Take the `n` jobs to start next (fewer if fewer wait), in the order above."""
        if n <= 0 or not self._waiting:
            return []
        now = time.monotonic()
        self._warm = {h: until for h, until in self._warm.items() if until > now}
        families: dict[int, list[Waiting]] = {}  # by the hash of the first block: jobs that may share blocks
        for w in self._waiting:
            w.score = max(self.cached_blocks(w.hashes), self._warm_blocks(w.hashes)) if w.hashes else 0
            if w.hashes:
                families.setdefault(w.hashes[0], []).append(w)

        def key(w: Waiting) -> tuple:
            urgent = ((w.turn_at is not None and now - w.turn_at >= self.max_wait)
                      or (w.deadline_at is not None and w.deadline_at - now <= self.max_wait))
            return (-w.priority, 0, w.order, 0) if urgent else (-w.priority, 1, -w.score, w.order)

        heap = [(key(w), w.order, w) for w in self._waiting]
        heapq.heapify(heap)
        chosen: list[Waiting] = []
        taken: set[int] = set()
        while len(chosen) < n and heap:
            k, order, best = heapq.heappop(heap)
            if order in taken or k != key(best):  # taken, or its score rose since this entry was pushed
                continue
            taken.add(order)
            chosen.append(best)
            if self._turns:  # one more start: the next job in arrival order has had its turn
                self._turns.popleft().turn_at = now
            if best.hashes:  # its siblings share the blocks it is about to compute
                for h in best.hashes:
                    self._warm[h] = now + WARM_S
                for w in families[best.hashes[0]]:
                    score = self._warm_blocks(w.hashes)
                    if w.order not in taken and score > w.score:
                        w.score = score
                        heapq.heappush(heap, (key(w), w.order, w))
        self._waiting = [w for w in self._waiting if w.order not in taken]
        return chosen

    def _warm_blocks(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._warm:
                break
            n += 1
        return n
