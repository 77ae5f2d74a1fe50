"""The reader thread: waits for room in the engine, reads (and reclaims) that many entries from the queue's
streams, admits them (consumer.py settles those that cannot run) and hands the rest on to be prepared.

Entries read beyond the room another source took meanwhile are held, first in line next time. With
cache-aware admission the reader also reads ahead of the room, and chooses which jobs start (admission.py). A job
submitted again while this worker still runs a stale copy of it waits until that copy has left.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import redis

from producer.connection import UNAVAILABLE

from .admission import Lookahead
from .consumer import Consumer, InFlight, Job
from .flow import Capacity

log = logging.getLogger("redline.worker")

UPKEEP_EVERY_S = 5.0  # queue depths and dead consumers: one round trip this often
READER_STALL_S = 15.0  # a reader that has not come round for this long is not ready (its Redis hangs)


class Reader:
    """Reads jobs while the engine has room, until `stopping` is set; `done` is set once it has ended."""

    def __init__(self, consumer: Consumer, blocking, capacity: Capacity, in_flight: InFlight, settings, metrics,
                 stopping: threading.Event, start_job: Callable[[Job], None],
                 abort_lost: Callable[[list[str]], None], lookahead: Lookahead | None = None,
                 prompt_hashes: Callable[[Job], list[int]] = lambda job: []) -> None:
        self.consumer, self.blocking, self.capacity, self.in_flight = consumer, blocking, capacity, in_flight
        self.settings, self.metrics, self.stopping = settings, metrics, stopping
        self.start_job, self.abort_lost = start_job, abort_lost
        self.lookahead, self.prompt_hashes = lookahead, prompt_hashes  # cache-aware admission (admission.py)
        self.done = threading.Event()
        self.redis_error: str | None = None  # its last Redis call failed with this
        self.came_round = time.monotonic()  # when it last finished a pass of its loop
        self.queue_waiting: int | None = None  # entries not yet delivered or read ahead, as of its last upkeep
        self._held: list[Job] = []  # read beyond the engine's room; handed over first next time
        self._superseding: list[Job] = []  # wait until this worker's stale copy of the same job has left

    def stalled(self) -> str | None:
        """Why the reader is not reading, or None while it is."""
        if self.redis_error is not None:
            return f"Redis unreachable: {self.redis_error}"
        behind = time.monotonic() - self.came_round
        if behind > READER_STALL_S:
            return f"the reader has been stuck for {behind:.0f} s"
        return None

    def run(self) -> None:
        try:
            self._read_jobs()
        finally:  # after a failure too, so that the engine loop ends
            self._hand_back_held()
            self.done.set()

    def _read_jobs(self) -> None:
        reclaim_every = max(self.settings.claim_timeout / 2, 0.05)
        next_reclaim = next_upkeep = time.monotonic()
        ahead = self.lookahead
        while not self.stopping.is_set():
            self.came_round = time.monotonic()
            room = self.capacity.wait_for_room(timeout=min(reclaim_every, 1.0))
            if self.stopping.is_set():
                break
            jobs, self._held = self._held[:room], self._held[room:]
            try:
                entries, called = [], False
                free = room - len(jobs)
                want = free + (ahead.space() if ahead is not None else 0)  # read ahead of the room
                if want > 0 and time.monotonic() >= next_reclaim:
                    entries, called = self.consumer.reclaim(want, self.in_flight.entry_ids()), True
                    next_reclaim = time.monotonic() + reclaim_every
                if want > len(entries):
                    # a full engine, or jobs to start now: no waiting in Redis for more
                    idle = free > 0 and not (jobs or entries or self._superseding or (ahead is not None and len(ahead)))
                    entries += self.consumer.read(want - len(entries), block_ms=1000 if idle else 0)
                    called = True
                if self.stopping.is_set():  # began draining while we read: these never start here
                    self.consumer.hand_back_unread(entries)
                    self._held = jobs + self._held
                    break
                jobs += self._admit(entries, free)
                if time.monotonic() >= next_upkeep:
                    self._upkeep()
                    next_upkeep, called = time.monotonic() + UPKEEP_EVERY_S, True
                if called:
                    self.redis_error = None
            except UNAVAILABLE as e:  # a lost connection, or a cluster failing over
                self._held = jobs + self._held  # taken, never sent: first in line next time
                self.redis_error = str(e) or type(e).__name__
                log.warning("reading jobs failed (%s); retrying in 1 s", self.redis_error)
                self.stopping.wait(1.0)
                self.blocking.reopen()
                continue
            except redis.ResponseError as e:
                self._held = jobs + self._held
                if not self.consumer.recover(e):
                    raise
                continue
            self._hand_over(jobs)

    def _hand_over(self, jobs: list[Job]) -> None:
        """Start the jobs the engine still has room for (another source may have taken some); hold the rest."""
        room = self.capacity.take(len(jobs))
        jobs, self._held = jobs[:room], jobs[room:] + self._held
        for job in jobs:
            self.start_job(job)

    def _admit(self, entries, free: int) -> list[Job]:
        """Admit entries (with read-ahead, they join it and those chosen for `free` room start). A job
        submitted again (same id) after Redis lost the entry of a copy this worker still runs waits until that
        stale copy, stopped here, has left."""
        ready, waiting = [], []
        for job in self._superseding:
            (waiting if self.in_flight.get(job.job_id) else ready).append(job)
        if ready:  # the stale copies may have streamed tokens: a restart delta tells readers to drop them
            self.consumer.restart_streams(ready)
        if self.lookahead is None:
            admitted = self.consumer.admit(entries) if entries else []
        else:
            admitted = self._through_lookahead(entries, free)
        jobs, self._superseding = [], waiting
        for job in ready + admitted:
            held = self.in_flight.get(job.job_id)
            if held is None or held is job:  # a job read ahead is held already
                self.in_flight.add(job)
                jobs.append(job)
            else:
                self.abort_lost([job.job_id])
                self._superseding.append(job)
        return jobs

    def _through_lookahead(self, entries, free: int) -> list[Job]:
        """Entries join the jobs read ahead; start those due now and those chosen for `free` room."""
        ahead, start = self.lookahead, []
        for job in self.consumer.take(entries) if entries else []:
            if self.in_flight.get(job.job_id) is not None:  # a copy of a job held here: START decides now
                start.append(job)
                continue
            job.waiting = True
            self.in_flight.add(job)
            ahead.add(job, self.prompt_hashes(job))
        due, lost = ahead.due()
        for job in lost:  # another worker took it over while it waited here
            self._forget(job)
        picked = due + ahead.choose(free - len(start))
        try:
            run = self.consumer.start(start + [w.job for w in picked])
        except Exception:
            ahead.restore(picked)
            raise
        running = {id(job) for job in run}
        for w in picked:
            if id(w.job) not in running:  # settled (cancelled, expired, finished) instead
                self._forget(w.job)
        return run

    def _forget(self, job: Job) -> None:
        if self.in_flight.get(job.job_id) is job:
            self.in_flight.pop(job.job_id)

    def _hand_back_held(self) -> None:
        """Give back the jobs admitted but never given to the engine; after a Redis error, the rest stay
        pending for other workers to reclaim."""
        for job in self._held + self._superseding:
            try:
                self.consumer.hand_back(job.job_id, job.stream, job.entry_id)
            except redis.RedisError as e:
                log.warning("could not hand back jobs (%s); they stay pending for other workers", e)
                break
        for job in self._held:
            self.in_flight.pop(job.job_id)
        self._held, self._superseding = [], []
        if self.lookahead is not None:  # read ahead, never started: back to their streams
            ahead = self.lookahead.take_all()
            for job in ahead:
                try:
                    self.consumer.hand_back(job.job_id, job.stream, job.entry_id)
                except redis.RedisError as e:
                    log.warning("could not hand back jobs read ahead (%s); they stay pending for other workers", e)
                    break
            for job in ahead:
                self._forget(job)

    def _upkeep(self) -> None:
        depths, pending = self.consumer.queue_depths()
        self.queue_waiting = sum(depths.values()) + (len(self.lookahead) if self.lookahead is not None else 0)
        for priority, depth in depths.items():
            self.metrics.set_queue_depth(priority, depth)
        self.metrics.set_pending(pending)
        self.consumer.forget_dead_consumers(max(60.0, 10 * self.settings.claim_timeout))
