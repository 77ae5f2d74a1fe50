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
  3. then, of the family (the jobs whose first prompt block is the same) with the most leading blocks in the
     engine's prefix cache, or shared with jobs started in the last WARM_S seconds (their blocks are about to
     be computed), the oldest job; the family of the oldest job of equals.
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
RESCORE_EVERY_S = 1.0  # every family's score is read again this often (others are read as they come up)


@dataclass(eq=False)
class Waiting:
    """A job read ahead, with what choosing it needs."""

    job: Job
    priority: int
    order: int  # arrival here: the oldest of equals first
    deadline_at: float | None  # time.monotonic() of its deadline, from its entry id (Redis's clock)
    hashes: list[int] = field(default_factory=list)  # its prompt's leading block hashes (prefix_block_hashes)
    turn_at: float | None = None  # when arrival order would have started it (time.monotonic())
    taken: bool = False  # chosen, due or taken over: left the read-ahead

    @property
    def family(self) -> object:
        """Jobs that may share blocks: the hash of their first block (a prompt of no whole block: its own)."""
        return self.hashes[0] if self.hashes else ("own", self.order)


def entry_deadline(entry_id: str, deadline_s: float | None) -> float | None:
    """A deadline measured from the entry's enqueue (its id's milliseconds), on this process's monotonic clock."""
    if deadline_s is None:
        return None
    enqueued_s = int(entry_id.split("-", 1)[0]) / 1000
    return time.monotonic() + enqueued_s + deadline_s - time.time()


class _Level:
    """The jobs of one priority read ahead. Structures are updated lazily: a taken job stays in them until it
    reaches a front, and a family's place in the heap is checked (its score read again) when it comes up."""

    def __init__(self) -> None:
        self.families: dict[object, deque[Waiting]] = {}  # each in arrival order
        self.family_heap: list[tuple] = []  # (-score, oldest order, stamp, family): one live entry a family
        self.live: dict[object, int] = {}  # family -> the stamp of its live entry (older entries are dropped)
        self.turned: deque[Waiting] = deque()  # had their turn, in arrival order
        self.deadlines: list[tuple[float, int, Waiting]] = []  # (deadline_at, order, job): the nearest first
        self.pushes = 0

    def add(self, w: Waiting, score: int) -> None:
        members = self.families.get(w.family)
        if members is None:
            members = self.families[w.family] = deque()
        members.append(w)
        if len(members) == 1:
            self.push(w.family, score, w.order)
        if w.deadline_at is not None:
            heapq.heappush(self.deadlines, (w.deadline_at, w.order, w))

    def push(self, family: object, score: int, oldest: int) -> None:
        self.pushes += 1  # unique: families of different kinds are never compared
        self.live[family] = self.pushes
        heapq.heappush(self.family_heap, (-score, oldest, self.pushes, family))

    def is_live(self, entry: tuple) -> bool:
        return self.live.get(entry[3]) == entry[2]

    def front(self, family: object) -> Waiting | None:
        """The oldest job of a family still waiting (None: the family is gone)."""
        members = self.families.get(family)
        while members and members[0].taken:
            members.popleft()
        if not members:
            self.families.pop(family, None)
            self.live.pop(family, None)
            return None
        return members[0]


class Lookahead:
    """The jobs read ahead (the reader thread's alone), at most `capacity` of them."""

    def __init__(self, capacity: int, max_wait: float, cached_blocks: Callable[[list[int]], int]) -> None:
        self.capacity, self.max_wait, self.cached_blocks = capacity, max_wait, cached_blocks
        self._waiting: dict[int, Waiting] = {}  # by order
        self._levels: dict[int, _Level] = {}  # by priority
        self._warm: dict[int, float] = {}  # block hash -> until when it counts as shared
        self._order = 0
        self._turns: deque[Waiting] = deque()  # every job read ahead, in arrival order, until its turn comes
        self._rescored_at = time.monotonic()

    def __len__(self) -> int:
        return len(self._waiting)

    def space(self) -> int:
        return max(self.capacity - len(self._waiting), 0)

    def add(self, job: Job, hashes: list[int]) -> None:
        self._order += 1
        w = Waiting(job, job.spec.priority, self._order, entry_deadline(job.entry_id, job.spec.deadline_s), hashes)
        self._turns.append(w)
        self._insert(w)

    def _insert(self, w: Waiting) -> None:
        w.taken = False
        self._waiting[w.order] = w
        level = self._levels.get(w.priority)
        if level is None:
            level = self._levels[w.priority] = _Level()
        level.add(w, self._score(w.hashes))
        if w.turn_at is not None:
            level.turned.append(w)

    def take_all(self) -> list[Job]:
        jobs = [w.job for w in self._waiting.values()]
        self._waiting, self._levels, self._turns = {}, {}, deque()
        return jobs

    def restore(self, waiting: list[Waiting]) -> None:
        """Put back what due() or choose() took, when starting it failed (Redis unreachable)."""
        for w in waiting:
            self._insert(w)

    def due(self) -> tuple[list[Waiting], list[Job]]:
        """(jobs to start now whatever the room: past their deadline, or cancelled while read ahead; jobs
        another worker took over, to forget), both taken out."""
        now = time.monotonic()
        start, lost = [], []
        for w in list(self._waiting.values()):
            if w.job.abort_reason == "lost":
                self._take(w)
                lost.append(w.job)
            elif w.job.abort_reason is not None:
                start.append(self._take(w))
        for level in self._levels.values():
            while level.deadlines and level.deadlines[0][0] <= now:
                w = heapq.heappop(level.deadlines)[2]
                if not w.taken:
                    start.append(self._take(w))
        return start, lost

    def choose(self, n: int) -> list[Waiting]:
        """Take the `n` jobs to start next (fewer if fewer wait), in the order above."""
        now = time.monotonic()
        if now - self._rescored_at >= RESCORE_EVERY_S:
            self._rescore(now)
        chosen: list[Waiting] = []
        while len(chosen) < n and self._waiting:
            priorities = [p for p, lv in self._levels.items() if self._has_waiting(lv)]
            if not priorities:  # every waiting job is in a family with a place in line; never here
                break
            level = self._levels[max(priorities)]
            w = self._urgent(level, now) or self._best_family(level)
            chosen.append(self._take(w))
            if self._turns:  # one more start: the next job in arrival order has had its turn
                turn = self._turns.popleft()
                turn.turn_at = now
                if not turn.taken:
                    self._levels[turn.priority].turned.append(turn)
            for h in w.hashes:  # its siblings share the blocks it is about to compute
                self._warm[h] = now + WARM_S
            sibling = level.front(w.family)
            if sibling is not None:
                level.push(w.family, self._score(sibling.hashes), sibling.order)
        return chosen

    def _has_waiting(self, level: _Level) -> bool:
        heap = level.family_heap
        while heap and (not level.is_live(heap[0]) or level.front(heap[0][3]) is None):
            heapq.heappop(heap)
        return bool(heap)

    def _urgent(self, level: _Level, now: float) -> Waiting | None:
        """A job whose deadline falls within max_wait, else one kept back max_wait past its turn."""
        while level.deadlines and level.deadlines[0][2].taken:
            heapq.heappop(level.deadlines)
        if level.deadlines and level.deadlines[0][0] - now <= self.max_wait:
            return heapq.heappop(level.deadlines)[2]
        while level.turned and level.turned[0].taken:
            level.turned.popleft()
        if level.turned and now - level.turned[0].turn_at >= self.max_wait:
            return level.turned.popleft()
        return None

    def _best_family(self, level: _Level) -> Waiting:
        """The oldest job of the family with the most leading blocks cached or shared (the oldest of equals);
        a family's score is read again when it comes up, and it goes back when that changed."""
        while True:
            entry = heapq.heappop(level.family_heap)
            neg_score, oldest, _, family = entry
            w = level.front(family) if level.is_live(entry) else None
            if w is None:
                continue
            score = self._score(w.hashes)
            if (score, w.order) == (-neg_score, oldest):
                level.live.pop(family)  # the caller puts it back in line for its next job
                return w
            level.push(family, score, w.order)

    def _rescore(self, now: float) -> None:
        """Every family's place again: a prefix may have come into the cache through other jobs."""
        self._rescored_at = now
        self._warm = {h: until for h, until in self._warm.items() if until > now}
        for level in self._levels.values():
            level.family_heap = []
            for family in list(level.families):
                w = level.front(family)
                if w is not None:
                    level.push(family, self._score(w.hashes), w.order)

    def _take(self, w: Waiting) -> Waiting:
        w.taken = True
        self._waiting.pop(w.order, None)
        return w

    def _score(self, hashes: list[int]) -> int:
        """Leading blocks in the prefix cache, or shared with a job started in the last WARM_S seconds."""
        return max(self.cached_blocks(hashes), self._warm_blocks(hashes)) if hashes else 0

    def _warm_blocks(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._warm:
                break
            n += 1
        return n
