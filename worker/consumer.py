"""Reading jobs from the consumer group: fresh entries, reclaimed ones, heartbeats and dead letters.

Every entry this worker holds is a `Job` in `InFlight` until its result is written and acked (or it is
handed back). Entries that cannot run (malformed, cancelled, past their deadline, already finished,
delivered too often) are settled here, in the reader thread, and never reach the engine.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import redis

from producer import protocol as p
from producer.connection import UNAVAILABLE
from producer.scripts import finish_keys

from .scripts import WorkerScripts

log = logging.getLogger("redline.worker")


@dataclass
class Job:
    """One delivered stream entry, from admission until its entry is acked."""

    job_id: str
    stream: str
    entry_id: str
    spec: p.JobSpec | None = None
    attempt: int = 1
    queue_s: float = 0.0  # enqueue → admission, by the Redis clock
    admitted_at: float = field(default_factory=time.monotonic)
    handed_at: float | None = None  # when the engine took it
    abort_reason: str | None = None  # "cancel" | "lost" | "handback" once the engine is told to stop it
    entry_gone: bool = False  # its entry vanished with Redis's data: its result is still written, nothing acked
    source: object | None = None  # None: a stream entry; else the job source that stores its states (celery_source)
    prompt: object | None = None  # chat with images: the prompt prepared before the engine took it (prepare.py)
    start_error: str | None = None  # why it cannot start, found while it was prepared (prepare.py)
    waiting: bool = False  # read ahead: pending here, not yet started (its status still queued; admission.py)


@dataclass
class Entry:
    stream: str
    entry_id: str
    fields: dict
    deliveries: int = 1


class InFlight:
    """The jobs this worker holds, by job id; shared by the reader, engine and writer threads."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._early_cancels: OrderedDict[str, None] = OrderedDict()  # cancels seen before their job

    def add(self, job: Job) -> None:
        with self._lock:
            self._jobs[job.job_id] = job
            if job.job_id in self._early_cancels:
                del self._early_cancels[job.job_id]
                job.abort_reason = "cancel"

    def cancel(self, job_id: str) -> Job | None:
        """Mark a job cancelled; returns it if the engine must abort it now. A cancel for a job not
        (yet) held is remembered, so a job admitted a moment later still sees it."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                self._early_cancels[job_id] = None
                while len(self._early_cancels) > 10_000:
                    self._early_cancels.popitem(last=False)
                return None
            if job.abort_reason is not None:
                return None
            job.abort_reason = "cancel"
            return job

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def pop(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.pop(job_id, None)

    def entry_ids(self) -> set[str]:
        with self._lock:
            return {j.entry_id for j in self._jobs.values()}

    def by_stream(self) -> dict[str, list[str]]:
        """Entry ids of the stream jobs whose entries are still in the group, by stream."""
        with self._lock:
            out: dict[str, list[str]] = {}
            for job in self._jobs.values():
                if not job.entry_gone and job.source is None:
                    out.setdefault(job.stream, []).append(job.entry_id)
            return out

    def jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    def __len__(self) -> int:
        return len(self._jobs)


def group_missing(error: redis.ResponseError) -> bool:
    """Whether Redis says a job stream or its consumer group does not exist (it came back empty)."""
    text = str(error)
    return "NOGROUP" in text or "no such key" in text.lower() or "stream key no longer exists" in text


def parse_entry(entry: Entry, max_job_bytes: int) -> tuple[str, p.JobSpec | None, str | None]:
    """(job id, spec, error). The job id falls back to the entry id when the entry has no valid one."""
    fields = {p.decode(k): v for k, v in entry.fields.items()}
    job_id, error = entry.entry_id, None
    if "job_id" not in fields:
        error = "the entry has no job_id field"
    else:
        try:
            job_id = p.check_job_id(p.decode(fields["job_id"]))
        except ValueError as e:
            error = str(e)
    if error is None and "job" not in fields:
        error = f"the entry has no job field (it has: {', '.join(sorted(fields)) or 'nothing'})"
    if error is not None:
        return job_id, None, error
    raw = fields["job"]
    if len(raw) > max_job_bytes:
        return job_id, None, (f"the job is {len(raw):,} bytes; this worker takes at most {max_job_bytes:,} "
                              "(max_job_bytes)")
    try:
        return job_id, p.JobSpec.model_validate_json(raw, context=p.AT_WORKER), None
    except p.ValidationError as e:
        return job_id, None, f"invalid job: {p.describe_validation_error(e)}"


class Consumer:
    """The reader thread's view of the queue."""

    def __init__(self, client: redis.Redis, keys: p.Keys, scripts: WorkerScripts, settings, metrics,
                 blocking) -> None:
        self.redis, self.keys, self.scripts = client, keys, scripts
        self.blocking = blocking  # a BlockingConnection: the blocking read has a connection of its own
        self.settings, self.metrics = settings, metrics
        self.name = settings.worker_name
        self.streams = keys.all_jobs()
        self._claim_cursor = {s: "0-0" for s in self.streams}
        self._regroup_lock = threading.Lock()

    def ensure_groups(self) -> int:
        """Create each stream's consumer group (and the stream) where missing; returns how many were made."""
        created = 0
        for stream in self.streams:
            try:
                self.redis.xgroup_create(stream, p.GROUP, id="0", mkstream=True)
                created += 1
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        return created

    def recover(self, error: redis.ResponseError) -> bool:
        """After an error saying a stream or group is missing, recreate the groups and return True;
        return False for any other error, which the caller raises."""
        if not group_missing(error):
            return False
        with self._regroup_lock:  # the reader and the writer may both notice; one of them warns
            try:
                created = self.ensure_groups()
            except UNAVAILABLE:
                return True  # Redis went away again: the next call meets the missing group again
            if created:
                self._claim_cursor = {s: "0-0" for s in self.streams}
                log.warning("the queue's consumer groups were gone (%s): Redis lost its data (a restart without "
                            "persistence, a failover, FLUSHALL?); recreated them, serving on", str(error)[:100])
        return True

    # ---- reading ----

    def read(self, n: int, block_ms: int) -> list[Entry]:
        """Up to `n` new entries, highest priority first; blocks up to block_ms only if all are empty.
        A blocking read may return one entry per stream, so more than `n` when n < number of streams."""
        entries: list[Entry] = []
        for stream in self.streams:
            if len(entries) >= n:
                return entries
            reply = self.redis.xreadgroup(p.GROUP, self.name, {stream: ">"}, count=n - len(entries))
            entries += self._entries(reply)
        if entries or block_ms <= 0:
            return entries
        per_stream = max(1, n // len(self.streams))
        reply = self.blocking.redis.xreadgroup(p.GROUP, self.name, {s: ">" for s in self.streams},
                                               count=per_stream, block=block_ms)
        return self._entries(reply)

    @staticmethod
    def _entries(reply) -> list[Entry]:
        out = []
        for stream, items in reply or []:
            for entry_id, fields in items:
                if fields is not None:
                    out.append(Entry(p.decode(stream), p.decode(entry_id), fields))
        return out

    def reclaim(self, n: int, held: set[str]) -> list[Entry]:
        """Take over up to `n` entries idle longer than the claim timeout (their worker died), with
        their delivery counts. Entries deleted from the stream while pending are acked and dropped:
        Redis 7 reports them apart (and drops them itself); Redis 6.2 returns them as nil."""
        min_idle = int(self.settings.claim_timeout * 1000)
        found: list[Entry] = []
        for stream in self.streams:
            if len(found) >= n:
                break
            reply = self.redis.execute_command("XAUTOCLAIM", stream, p.GROUP, self.name, min_idle,
                                               self._claim_cursor[stream], "COUNT", n - len(found))
            self._claim_cursor[stream] = p.decode(reply[0])
            claimed = [(p.decode(i), f) for i, f in reply[1] if i is not None]
            has_deleted = len(claimed) < len(reply[1]) or (len(reply) > 2 and reply[2])
            fresh = [(i, f) for i, f in claimed if i not in held]  # ours already: only refreshed
            if not fresh and not has_deleted:
                continue
            mine = self.redis.xpending_range(stream, p.GROUP, "-", "+", 10_000, consumername=self.name)
            deliveries = {p.decode(m["message_id"]): m["times_delivered"] for m in mine}
            claimed_ids = {i for i, _ in claimed}
            orphans = [i for i in deliveries if i not in claimed_ids and i not in held]
            if orphans and has_deleted:  # 6.2: deleted entries stay pending, owned by us now
                gone = [i for i in orphans if not self.redis.xrange(stream, i, i)]
                if gone:
                    self.redis.xack(stream, p.GROUP, *gone)
                    log.info("acked %d entries deleted from %s while pending", len(gone), stream)
            for entry_id, fields in fresh:
                found.append(Entry(stream, entry_id, fields, deliveries.get(entry_id, 1)))
        if found:
            self.metrics.job_redelivered(len(found))
            log.info("reclaimed %d entries from workers idle over %.1f s", len(found), self.settings.claim_timeout)
        return found

    # ---- admission ----

    def admit(self, entries: list[Entry]) -> list[Job]:
        """Settle what cannot run; mark the rest running (one attempt each) and return them."""
        return self.start(self.take(entries))

    def take(self, entries: list[Entry]) -> list[Job]:
        """Settle the entries that cannot run (malformed, delivered too often); the others as jobs, not started."""
        s = self.settings
        pipe = self.redis.pipeline(transaction=False)
        jobs: list[Job] = []
        for entry in entries:
            job_id, spec, error = parse_entry(entry, s.max_job_bytes)
            if error is None and entry.deliveries > s.max_deliveries:
                self._dead_letter(entry, job_id)
            elif error is not None:
                log.info("job %s (entry %s) fails: %s", job_id, entry.entry_id, error)
                self._finish_call(pipe, job_id, entry, p.FAILED, error)
            else:
                jobs.append(Job(job_id, entry.stream, entry.entry_id, spec))
        for written in (pipe.execute() if len(pipe) else []):  # 1 if this wrote the failed result
            if written:
                self.metrics.job_completed(p.FAILED)
        self.metrics.job_received(len(entries))
        return jobs

    def start(self, jobs: list[Job]) -> list[Job]:
        """START each job (one attempt each): those to run are returned; a cancelled, expired, finished or
        duplicate one is settled in Redis."""
        if not jobs:
            return []
        s = self.settings
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            spec = job.spec
            ks = finish_keys(self.keys, job.job_id, job.stream)
            cancelled, cancelled_end = p.final_args(job.job_id, p.CANCELLED, "cancelled before it started")
            expired, expired_end = p.final_args(
                job.job_id, p.EXPIRED, f"the deadline of {spec.deadline_s:g} s after enqueue passed before it "
                "started" if spec.deadline_s else "")
            self.scripts.start(keys=ks, args=[job.job_id, job.entry_id, self.name,
                                              "" if spec.deadline_s is None else repr(spec.deadline_s),
                                              s.result_ttl, p.RESULTS_FEED_MAXLEN, cancelled, cancelled_end,
                                              expired, expired_end], client=pipe)
        run: list[Job] = []
        for job, (outcome, attempts, queue_ms) in zip(jobs, pipe.execute()):
            outcome = p.decode(outcome)
            if outcome == "run":
                job.attempt, job.queue_s = int(attempts), max(int(queue_ms), 0) / 1000
                job.admitted_at, job.waiting = time.monotonic(), False
                run.append(job)
            elif outcome in (p.CANCELLED, p.EXPIRED):
                self.metrics.job_completed(outcome)
            else:
                log.info("job %s: entry %s is %s; acked without running", job.job_id, job.entry_id, outcome)
        return run

    def _finish_call(self, pipe, job_id: str, entry: Entry, status: str, error: str) -> None:
        result, end = p.final_args(job_id, status, error)
        self.scripts.finish_job(self.keys, job_id, entry.stream, entry.entry_id, status, result, end,
                                self.settings.result_ttl, client=pipe)

    def _dead_letter(self, entry: Entry, job_id: str) -> None:
        last_error = self.redis.hget(self.keys.job(job_id), "last_error")
        error = (f"delivered {entry.deliveries} times without a result (max_deliveries is "
                 f"{self.settings.max_deliveries}): each worker that took it stopped before finishing")
        if last_error:
            error += f"; last error: {p.decode(last_error)}"
        result, end = p.final_args(job_id, p.FAILED, error)
        ks = finish_keys(self.keys, job_id, entry.stream, self.keys.dead)
        moved = self.scripts.dead_letter(keys=ks, args=[job_id, entry.entry_id, entry.deliveries, error, result,
                                                        end, self.settings.result_ttl, p.RESULTS_FEED_MAXLEN])
        if moved:
            log.warning("job %s dead-lettered: %s", job_id, error)
            self.metrics.job_dead_lettered()
            self.metrics.job_completed(p.FAILED)

    # ---- upkeep ----

    def heartbeat(self, in_flight: InFlight) -> list[str]:
        """Refresh the idle time of every entry this worker holds; return the job ids another worker took
        over. Entries that vanished with Redis's data are marked `entry_gone`: those jobs run on."""
        not_mine: set[str] = set()
        for stream, entry_ids in in_flight.by_stream().items():
            for i in range(0, len(entry_ids), 2000):
                chunk = entry_ids[i:i + 2000]
                try:
                    not_mine.update(p.decode(e) for e in self.scripts.heartbeat(keys=[stream], args=[self.name, *chunk]))
                except redis.ResponseError as e:
                    if not self.recover(e):
                        raise
                    not_mine.update(chunk)
        if not not_mine:
            return []
        jobs = [j for j in in_flight.jobs() if j.entry_id in not_mine]
        taken = self._taken_over(jobs)
        gone = [j for j in jobs if j.job_id not in taken]
        for job in gone:
            job.entry_gone = True
        if gone:
            log.info("%d running jobs lost their queue entries with Redis's data; their results are written "
                     "as usual", len(gone))
        return [j.job_id for j in jobs if j.job_id in taken]

    def _taken_over(self, jobs: list[Job]) -> set[str]:
        """Of jobs whose entries this worker no longer holds, those pending at another worker or final."""
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.xpending_range(job.stream, p.GROUP, job.entry_id, job.entry_id, 1)
            pipe.hget(self.keys.job(job.job_id), "status")
        replies = pipe.execute(raise_on_error=False)  # a missing group (an error reply) holds nothing
        return {job.job_id for job, pending, status in zip(jobs, replies[::2], replies[1::2])
                if (isinstance(pending, list) and pending) or (status and p.decode(status) in p.FINAL_STATUSES)}

    def hand_back(self, job_id: str, stream: str, entry_id: str) -> None:
        """Give an entry this worker will not finish back to its stream, for any worker to take."""
        self.scripts.handback(keys=[self.keys.job(job_id), stream], args=[job_id, entry_id])

    def restart_streams(self, jobs: list[Job]) -> None:
        """Start each job's token stream over (a restart delta), dropping what a stale copy sent."""
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            delta = p.TokenDelta(restart=True, attempt=job.attempt)
            pipe.xadd(self.keys.tokens(job.job_id), {"data": delta.model_dump_json()})
        pipe.execute()

    def hand_back_unread(self, entries: list[Entry]) -> None:
        """Hand back entries read but never admitted (the worker began to drain meanwhile)."""
        for entry in entries:
            job_id, _, _ = parse_entry(entry, self.settings.max_job_bytes)
            self.hand_back(job_id, entry.stream, entry.entry_id)

    def queue_depths(self) -> tuple[dict[str, int], int]:
        """(entries not yet delivered, per priority), and entries delivered but not acked."""
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xlen(stream)
            pipe.xpending(stream, p.GROUP)
        replies = pipe.execute()
        depths, pending = {}, 0
        for priority, (length, summary) in zip(p.PRIORITIES, zip(replies[::2], replies[1::2])):
            n = summary["pending"] if isinstance(summary, dict) else 0
            depths[str(priority)] = max(length - n, 0)
            pending += n
        return depths, pending

    def forget_dead_consumers(self, idle_s: float) -> None:
        """Remove consumers with nothing pending that have not been seen for idle_s (killed workers)."""
        for stream in self.streams:
            for c in self.redis.xinfo_consumers(stream, p.GROUP):
                name = p.decode(c["name"])
                if name != self.name and c["pending"] == 0 and c["idle"] > idle_s * 1000:
                    self.redis.xgroup_delconsumer(stream, p.GROUP, name)
