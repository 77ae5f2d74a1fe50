"""The worker: one loop drives the engine; Redis I/O runs beside it on three threads.

    reader  (consumer.py)  waits for engine room, reads/reclaims that many jobs, settles bad ones
    prepare (prepare.py)   a few threads: grammars compiled and images decoded before a job enters the engine
    engine  (this file)    add_request / abort / step, hands each step's outputs to the writer
    writer  (results.py)   token deltas, results + acks, heartbeats
    cancels (this file)    watches the cancel stream and tells the engine loop which jobs to abort
    celery  (celery_source.py, with --celery-queue)  a Celery queue as a second source of jobs

The engine thread never waits on Redis: it exchanges plain Python objects with the others through
queues, and publishes how many more jobs the engine can start (`Capacity`).

A worker never hangs: lost consumer groups are recreated (consumer.py), a thread that fails stops the
worker with exit code 1, and every wait on the way out is bounded by the drain deadline.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import redis

from producer import protocol as p
from producer.connection import UNAVAILABLE

from .blocking import BlockingConnection, when_available
from .consumer import Consumer, InFlight, Job
from .prepare import Preparation
from .results import STOP, ResultWriter
from .scripts import WorkerScripts
from .stats import NullMetrics, StatsLog

log = logging.getLogger("redline.worker")

SHUTDOWN_GRACE_S = 2.0  # past the drain deadline, the last writes may retry this long before the worker exits
UPKEEP_EVERY_S = 5.0  # queue depths and dead consumers: one round trip this often
READER_STALL_S = 15.0  # a reader that has not come round for this long is not ready (its Redis hangs)


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


class Worker:
    """Serve one queue with one engine until `stop()`; `run()` returns the exit code."""

    def __init__(self, settings, engine, client: redis.Redis, metrics=None) -> None:
        self.settings, self.engine, self.redis = settings, engine, client
        self.metrics = metrics or NullMetrics()
        self.keys = p.Keys(settings.queue)
        self.scripts = WorkerScripts(client)
        self.in_flight = InFlight()
        self.capacity = Capacity()
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # ("run", Job) | ("abort", job_id)
        self.preparation = Preparation(engine, lambda job: self.commands.put(("run", job)))
        self.stopping = threading.Event()
        # The threads that block in Redis get connections of their own, so stop() can unblock them.
        self._reader = BlockingConnection(client, self.keys.jobs())
        self._cancels = BlockingConnection(client, self.keys.cancels)
        self.consumer = Consumer(client, self.keys, self.scripts, settings, self.metrics, self._reader)
        self.writer = ResultWriter(client, self.keys, self.scripts, self.consumer, self.in_flight, settings,
                                   self.metrics, getattr(engine, "tokenizer", None), self._abort_lost)
        self.reader_done = threading.Event()
        self.drain_deadline: float | None = None
        self.ready = threading.Event()  # set once the consumer group exists and the loop is running
        self.closed = threading.Event()  # set once the writer has written everything
        self.failed = False  # a thread or the engine failed: exit code 1
        self.failure: str | None = None  # which, and how: what /healthz reports
        self.redis_error: str | None = None  # the reader's last Redis call failed with this
        self.reader_came_round = time.monotonic()  # when the reader last finished a pass of its loop
        self._threads: list[threading.Thread] = []
        self._held: list[Job] = []  # read beyond the engine's room; handed over first next time
        self._superseding: list[Job] = []  # wait until this worker's stale copy of the same job has left
        self.queue_waiting: int | None = None  # entries not yet delivered, as of the reader's last upkeep
        self.stats = StatsLog()
        self.streaming: set[str] = set()  # engine thread only: jobs in the engine that want token deltas
        self.sources = []  # job sources beside the queue's streams, each with a thread of its own
        if settings.celery_queue:
            from .celery_source import CelerySource  # celery is imported only by a worker that serves it

            self.sources.append(CelerySource(self))
        self.metrics.report_health(self)

    @property
    def reader_redis(self) -> redis.Redis:
        return self._reader.redis

    @property
    def cancels_redis(self) -> redis.Redis:
        return self._cancels.redis

    # ---- health: what /healthz and /readyz answer ----

    def liveness(self) -> tuple[bool, str]:
        """Not live once a thread has failed or died: the worker is about to exit 1 (or hangs on the way)."""
        if self.failed:
            return False, self.failure or "a worker thread failed"
        dead = [t.name for t in self._threads if not t.is_alive()]
        if dead and not self.stopping.is_set():
            return False, f"{', '.join(dead)} died"
        return True, "alive"

    def readiness(self) -> tuple[bool, str]:
        """Ready while it reads jobs: engine loaded, groups made, Redis answering, not stopping."""
        if self.closed.is_set():
            return False, "stopped: everything written"
        if self.stopping.is_set():
            return False, f"draining: {len(self.in_flight)} jobs in flight"
        if not self.ready.is_set():
            return False, "starting"
        if self.redis_error is not None:
            return False, f"Redis unreachable: {self.redis_error}"
        behind = time.monotonic() - self.reader_came_round
        if behind > READER_STALL_S:
            return False, f"the reader has been stuck for {behind:.0f} s"
        return True, f"reading queue {self.settings.queue!r}"

    # ---- control ----

    def stop(self, now: bool = False) -> None:
        """Drain: read no more jobs, let running ones finish (up to drain_timeout), hand back the rest."""
        if not self.stopping.is_set():
            log.info("draining: %d jobs in flight", len(self.in_flight))
            self.drain_deadline = time.monotonic() + self.settings.drain_timeout
        if now:
            self.drain_deadline = min(self.drain_deadline, time.monotonic())
        self.writer.give_up_at = self.drain_deadline + SHUTDOWN_GRACE_S
        self.stopping.set()
        self.capacity.wake()
        self.commands.put(("wake", None))
        self._reader.unblock()

    def _log_kv_capacity(self) -> None:
        """How many tokens the engine's KV cache holds and how many sequences of max_model_len fit at once,
        as vLLM reports it: a cache far smaller than expected (another process on the GPU, a low
        gpu_memory_utilization) shows here rather than only as low throughput."""
        bm, config = getattr(self.engine, "block_manager", None), getattr(self.engine, "config", None)
        if bm is None or config is None:
            return
        tokens = bm.num_blocks * config.kvcache_block_size
        log.info("KV cache: %d blocks of %d tokens (%d tokens), room for %.1f sequences of max_model_len %d "
                 "at once (max_num_seqs %d)", bm.num_blocks, config.kvcache_block_size, tokens,
                 tokens / config.max_model_len, config.max_model_len, config.max_num_seqs)

    def run(self) -> int:
        """Serve until stop(); 0 after a drain, 1 if the engine or a thread failed."""
        when_available(self.consumer.ensure_groups, "creating the consumer groups", self.stopping)
        writer = threading.Thread(target=self._guard(self.writer.run), name="redline-writer", daemon=True)
        others = [threading.Thread(target=self._guard(self._read_loop), name="redline-reader", daemon=True),
                  threading.Thread(target=self._guard(self._cancel_loop), name="redline-cancels", daemon=True),
                  *(threading.Thread(target=self._guard(s.run), name=f"redline-{s.name}", daemon=True)
                    for s in self.sources)]
        self._threads = [writer, *others]
        for t in self._threads:
            t.start()
        log.info("worker %s serving queue %r", self.settings.worker_name, self.settings.queue)
        self._log_kv_capacity()
        self.ready.set()
        try:
            self._engine_loop()
        except Exception as e:
            log.exception("the engine failed; in-flight jobs stay pending for other workers to reclaim")
            self._record_error(f"the engine failed on worker {self.settings.worker_name}: {type(e).__name__}: {e}")
            self.failure = f"the engine failed: {type(e).__name__}: {e}"
            self.failed = True
            self.stop(now=True)
        self._finish_threads(writer, others)
        code = 1 if self.failed else 0
        if code == 0 and not len(self.in_flight):
            try:
                for stream in self.consumer.streams:
                    self.redis.xgroup_delconsumer(stream, p.GROUP, self.settings.worker_name)
            except redis.RedisError:
                pass
        log.info("worker %s stopped", self.settings.worker_name)
        return code

    def _finish_threads(self, writer: threading.Thread, others: list[threading.Thread]) -> None:
        """Let the writer write what is left, then the other threads end. Every wait is bounded: a thread
        may have died, or hang in a call to a Redis that stopped answering."""
        self.writer.outbox.put(STOP)
        writer.join(max(self.drain_deadline + SHUTDOWN_GRACE_S - time.monotonic(), 0) + 1.0)
        if writer.is_alive():
            log.error("the last results were not written in time; their jobs stay pending for other workers")
        self.closed.set()
        self._cancels.unblock()
        end = time.monotonic() + 1.0  # the reader and the cancels end within a second unless Redis hangs
        for t in others:
            t.join(max(end - time.monotonic(), 0))

    def _guard(self, target):
        def run() -> None:
            try:
                target()
            except Exception as e:
                name = threading.current_thread().name
                log.exception("%s failed; stopping the worker (exit code 1)", name)
                self.failure = f"{name} failed: {type(e).__name__}: {e}"
                self.failed = True
                self.stop(now=True)
        return run

    # ---- the engine thread ----

    def _engine_loop(self) -> None:
        engine = self.engine
        self.capacity.publish(engine.num_free_slots())
        while True:
            received = self._apply_commands(block=not engine.has_unfinished())
            if engine.has_unfinished():
                result = engine.step()
                self.metrics.observe_step(result.stats)
                self.stats.observe(result)
                outputs = result.outputs
                if self.streaming:
                    self.streaming.difference_update(o.request_id for o in outputs if o.finished)
                else:  # no running job wants token deltas: the writer needs only the finished ones
                    outputs = [o for o in outputs if o.finished]
                if outputs:
                    self.writer.outbox.put(("step", outputs))
            elif self._drained():
                return
            self.capacity.publish(engine.num_free_slots(), received)
            if self.stopping.is_set() and time.monotonic() >= self.drain_deadline:
                self._hand_back_running()
            self.stats.maybe_log(self.queue_waiting)

    def _drained(self) -> bool:
        """Stopping, with nothing left for the engine, and the reader done (or past waiting for it: it may
        hang in a call to a Redis that stopped answering)."""
        if not self.stopping.is_set() or not self.commands.empty():
            return False
        if len(self.preparation) and time.monotonic() < self.drain_deadline:
            return False
        if self.reader_done.is_set() and all(s.reading_done.is_set() for s in self.sources):
            return True
        return time.monotonic() >= self.drain_deadline + SHUTDOWN_GRACE_S

    def _apply_commands(self, block: bool) -> int:
        """Add new jobs to the engine and abort cancelled ones; returns how many jobs arrived."""
        received = 0
        try:
            command = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
        except queue.Empty:
            return 0
        while True:
            kind, value = command
            if kind == "run":
                received += 1
                self._start(value)
            elif kind == "abort":
                self.engine.abort(value)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return received

    def _start(self, job: Job) -> None:
        if job.abort_reason == "cancel":
            self.writer.outbox.put(("cancelled", job, "cancelled before it started"))
            return
        if job.abort_reason is not None:
            self.in_flight.pop(job.job_id)
            return
        if self.stopping.is_set() and time.monotonic() >= self.drain_deadline:
            self.writer.outbox.put(("handback", job, None))
            return
        spec = job.spec
        if job.prompt_error is not None:
            self.writer.outbox.put(("failed", job, job.prompt_error))
            return
        try:
            prompt = spec.prompt_token_ids or spec.prompt
            if job.prompt is not None:
                prompt, job.prompt = job.prompt, None
            elif spec.messages is not None:
                prompt = self.engine.encode_chat([m.model_dump() for m in spec.messages])
            self.engine.add_request(prompt, spec.sampling.model_dump(exclude_none=True), request_id=job.job_id)
        except ValueError as e:
            self.writer.outbox.put(("failed", job, str(e)))
            return
        except Exception as e:  # a template or tokenizer error is the job's problem, not the worker's
            log.exception("job %s could not start", job.job_id)
            self.writer.outbox.put(("failed", job, f"could not start: {type(e).__name__}: {e}"))
            return
        if spec.stream:
            self.streaming.add(job.job_id)
        if job.source is not None:
            self.writer.outbox.put(("started", job, None))
        job.handed_at = time.monotonic()
        self.metrics.observe_queue_time(job.queue_s + job.handed_at - job.admitted_at)

    def _hand_back_running(self) -> None:
        for job in self.preparation.take_all():
            self.writer.outbox.put(("handback", job, None))
        for job in self.in_flight.jobs():
            if job.abort_reason is None and job.handed_at is not None:
                job.abort_reason = "handback"
                self.engine.abort(job.job_id)

    def _abort_lost(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            job = self.in_flight.get(job_id)
            if job is not None and job.abort_reason is None:
                job.abort_reason = "lost"
                self.preparation.cut_short(job)
                self.commands.put(("abort", job_id))

    # ---- the reader thread ----

    def _read_loop(self) -> None:
        try:
            self._read_jobs()
        finally:  # after a failure too, so that the engine loop ends
            self._hand_back_held()
            self.reader_done.set()
            self.commands.put(("wake", None))

    def _read_jobs(self) -> None:
        reclaim_every = max(self.settings.claim_timeout / 2, 0.05)
        next_reclaim = next_upkeep = time.monotonic()
        while not self.stopping.is_set():
            self.reader_came_round = time.monotonic()
            room = self.capacity.wait_for_room(timeout=min(reclaim_every, 1.0))
            if self.stopping.is_set():
                break
            jobs, self._held = self._held[:room], self._held[room:]
            try:
                entries, called = [], False
                if room > len(jobs) and time.monotonic() >= next_reclaim:
                    entries, called = self.consumer.reclaim(room - len(jobs), self.in_flight.entry_ids()), True
                    next_reclaim = time.monotonic() + reclaim_every
                if room > len(jobs) + len(entries):
                    block = 0 if jobs or entries or self._superseding else 1000
                    entries += self.consumer.read(room - len(jobs) - len(entries), block_ms=block)
                    called = True
                if self.stopping.is_set():  # began draining while we read: these never start here
                    self.consumer.hand_back_unread(entries)
                    self._held = jobs + self._held
                    break
                jobs += self._admit(entries)
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
                self._reader.reopen()
                continue
            except redis.ResponseError as e:
                self._held = jobs + self._held
                if not self.consumer.recover(e):
                    raise
                continue
            room = self.capacity.take(len(jobs))  # another source may have taken some room meanwhile
            jobs, self._held = jobs[:room], jobs[room:] + self._held
            for job in jobs:
                self.hand_to_engine(job)

    def hand_to_engine(self, job: Job) -> None:
        """Send an admitted job to the engine thread once its grammar is compiled and its images are
        decoded, on the preparation threads (prepare.py); the engine thread fails a job with its own error."""
        self.preparation.submit(job)

    def _admit(self, entries) -> list[Job]:
        """Admit entries. A job submitted again (same id) after Redis lost the entry of a copy this worker
        still runs waits until that stale copy, stopped here, has left."""
        ready, waiting = [], []
        for job in self._superseding:
            (waiting if self.in_flight.get(job.job_id) else ready).append(job)
        if ready:  # the stale copies may have streamed tokens: a restart delta tells readers to drop them
            self.consumer.restart_streams(ready)
        admitted = self.consumer.admit(entries) if entries else []
        jobs, self._superseding = [], waiting
        for job in ready + admitted:
            if self.in_flight.get(job.job_id) is None:
                self.in_flight.add(job)
                jobs.append(job)
            else:
                self._abort_lost([job.job_id])
                self._superseding.append(job)
        return jobs

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

    def _upkeep(self) -> None:
        depths, pending = self.consumer.queue_depths()
        self.queue_waiting = sum(depths.values())
        for priority, depth in depths.items():
            self.metrics.set_queue_depth(priority, depth)
        self.metrics.set_pending(pending)
        self.consumer.forget_dead_consumers(max(60.0, 10 * self.settings.claim_timeout))

    # ---- the cancel thread ----

    def _cancel_loop(self) -> None:
        last = None
        while not self.closed.is_set():
            try:
                if last is None:  # cancels from now on only
                    newest = self.cancels_redis.xrevrange(self.keys.cancels, count=1)
                    last = newest[0][0] if newest else "0-0"
                reply = self.cancels_redis.xread({self.keys.cancels: last}, count=100, block=1000)
            except UNAVAILABLE as e:
                log.warning("watching cancels failed (%s); retrying in 1 s", str(e) or type(e).__name__)
                self.closed.wait(1.0)
                self._cancels.reopen()
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    self.cancel(p.decode(fields.get(b"job_id", b"")))

    def cancel(self, job_id: str) -> None:
        """Cancel a job: aborted in the engine if it runs here, settled as cancelled if it arrives later."""
        job = self.in_flight.cancel(job_id)
        if job is not None:
            log.info("cancelling job %s", job.job_id)
            self.preparation.cut_short(job)
            self.commands.put(("abort", job.job_id))

    def _record_error(self, error: str) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            for job in self.in_flight.jobs():
                if job.source is None:
                    pipe.hset(self.keys.job(job.job_id), "last_error", error)
            pipe.execute()
        except redis.RedisError:
            pass
