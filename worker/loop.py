"""The worker: one thread drives the engine; Redis I/O runs beside it on threads of their own.

    reader  (reader.py)       waits for engine room, reads/reclaims that many jobs, settles bad ones (consumer.py);
                              with --cache-aware-admission reads ahead and chooses which start (admission.py)
    prepare (prepare.py)      a few threads: grammars compiled and images decoded before a job enters the engine
    engine  (engine_loop.py)  add_request / abort / step, hands each step's outputs to the writer
    writer  (results.py)      token deltas, results + acks, heartbeats
    cancels (this file)       watches the cancel stream and tells the engine thread which jobs to abort
    celery  (celery_source.py, with --celery-queue)  a Celery queue as a second source of jobs, through `JobSink`

The threads pass typed messages (messages.py) through queues and share the engine's room (`Capacity`) and
the drain (`Drain`); `Worker` wires them and answers /healthz and /readyz.

A worker never hangs: lost consumer groups are recreated (consumer.py), a thread that fails stops the
worker with exit code 1, and every wait on the way out is bounded by the drain deadline.
"""
from __future__ import annotations

import logging
import threading
import time

import redis

from producer import protocol as p
from producer.connection import UNAVAILABLE

from .admission import LOOKAHEAD_PER_SEQ, Lookahead
from .blocking import BlockingConnection, when_available
from .consumer import Consumer, InFlight, Job
from .engine_loop import SHUTDOWN_GRACE_S, EngineLoop
from .flow import Capacity, Drain
from .messages import AbortJob, RunJob, Wake
from .prepare import Preparation
from .reader import Reader
from .results import STOP, ResultWriter
from .scripts import WorkerScripts
from .stats import NullMetrics

log = logging.getLogger("redline.worker")

CANCELS_PER_READ = 100  # cancel entries read in one call


class Worker:
    """Serve one queue with one engine until `stop()`; `run()` returns the exit code. It is the `JobSink`
    of its other sources of jobs (celery_source.py)."""

    def __init__(self, settings, engine, client: redis.Redis, metrics=None) -> None:
        self.settings, self.engine, self.redis = settings, engine, client
        self.metrics = metrics or NullMetrics()
        self.keys = p.Keys(settings.queue)
        self.scripts = WorkerScripts(client)
        self.in_flight = InFlight()
        self.capacity = Capacity()
        self.drain = Drain()
        self.stopping = self.drain.stopping
        # The threads that block in Redis get connections of their own, so stop() can unblock them.
        self._reading = BlockingConnection(client, self.keys.jobs())
        self._cancels = BlockingConnection(client, self.keys.cancels)
        self.consumer = Consumer(client, self.keys, self.scripts, settings, self.metrics, self._reading)
        self.writer = ResultWriter(client, self.keys, self.scripts, self.consumer, self.in_flight, settings,
                                   self.metrics, self._abort_lost)
        self.preparation = Preparation(engine, lambda job: self.engine_loop.inbox.put(RunJob(job)))
        lookahead = None
        if settings.cache_aware_admission:
            slots = getattr(getattr(engine, "config", None), "max_num_seqs", None) or 256
            lookahead = Lookahead(settings.lookahead or LOOKAHEAD_PER_SEQ * slots, settings.admission_max_wait,
                                  engine.num_cached_blocks)
        self.reader = Reader(self.consumer, self._reading, self.capacity, self.in_flight, settings, self.metrics,
                             self.stopping, self.start_job, self._abort_lost, lookahead, self._prompt_hashes)
        self.sources = []  # job sources beside the queue's streams, each with a thread of its own
        if settings.celery_queue:
            from .celery_source import CelerySource  # celery is imported only by a worker that serves it

            self.sources.append(CelerySource(settings, self.metrics, self))
        self.engine_loop = EngineLoop(engine, self.in_flight, self.preparation, self.capacity, self.drain,
                                      self.writer.outbox, self.metrics, self.reader, self.sources,
                                      settings.lora_requests)
        self.ready = threading.Event()  # set once the consumer group exists and the loop is running
        self.closed = threading.Event()  # set once the writer has written everything
        self.failed = False  # a thread or the engine failed: exit code 1
        self.failure: str | None = None  # which, and how: what /healthz reports
        self._threads: list[threading.Thread] = []
        self.metrics.report_health(self)

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
        stalled = self.reader.stalled()
        if stalled is not None:
            return False, stalled
        return True, f"reading queue {self.settings.queue!r}"

    # ---- control ----

    def stop(self, now: bool = False) -> None:
        """Drain: read no more jobs, let running ones finish (up to drain_timeout), hand back the rest."""
        if not self.stopping.is_set():
            log.info("draining: %d jobs in flight", len(self.in_flight))
        self.drain.begin(self.settings.drain_timeout, now)
        self.writer.give_up_at = self.drain.deadline + SHUTDOWN_GRACE_S
        self.capacity.wake()
        self.engine_loop.inbox.put(Wake())
        self._reading.unblock()

    def run(self) -> int:
        """Serve until stop(); 0 after a drain, 1 if the engine or a thread failed."""
        when_available(self.consumer.ensure_groups, "creating the consumer groups", self.stopping)
        writer = threading.Thread(target=self._guard(self.writer.run), name="redline-writer", daemon=True)
        others = [threading.Thread(target=self._guard(self._read), name="redline-reader", daemon=True),
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
            self.engine_loop.run()
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

    def _finish_threads(self, writer: threading.Thread, others: list[threading.Thread]) -> None:
        """Let the writer write what is left, then the other threads end. Every wait is bounded: a thread
        may have died, or hang in a call to a Redis that stopped answering."""
        self.writer.outbox.put(STOP)
        writer.join(max(self.drain.deadline + SHUTDOWN_GRACE_S - time.monotonic(), 0) + 1.0)
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

    def _read(self) -> None:
        try:
            self.reader.run()
        finally:  # after a failure too, so that the engine thread sees the reader done
            self.engine_loop.inbox.put(Wake())

    # ---- the job sink (celery_source.JobSink): what the reader and other sources hand jobs to ----

    def take_room(self, n: int) -> int:
        return self.capacity.take(n)

    def hold(self, job: Job) -> bool:
        if self.in_flight.get(job.job_id) is not None:
            return False
        self.in_flight.add(job)
        return True

    def release(self, job_id: str) -> None:
        self.in_flight.pop(job_id)

    def start_job(self, job: Job) -> None:
        """Send an admitted job to the engine thread once its grammar is compiled and its images are
        decoded, on the preparation threads (prepare.py); the engine thread fails a job with its own error."""
        self.preparation.submit(job)

    def _prompt_hashes(self, job: Job) -> list[int]:
        """The prefix-cache hashes of a job read ahead (under its LoRA adapter's root), its prompt tokenized here
        once (the engine thread takes the ids); none for a model that takes images, or a job the engine thread
        will refuse."""
        spec, engine = job.spec, self.engine
        if getattr(engine, "images", None) is not None:
            return []
        lora = None
        if spec.lora is not None:
            lora = self.engine_loop.loras.get(spec.lora)
            if lora is None:  # an adapter this worker does not serve: the engine thread fails the job
                return []
        try:
            if spec.prompt_token_ids is not None:
                return engine.prefix_block_hashes(spec.prompt_token_ids, lora)
            if spec.messages is not None:
                job.prompt = engine.encode_chat([m.model_dump() for m in spec.messages])
            else:
                job.prompt = engine.prepare_prompt(spec.prompt)
        except Exception:  # noqa: BLE001 - a job can fail only itself: the engine thread fails it with the reason
            return []
        return engine.prefix_block_hashes(job.prompt, lora)

    def cancel(self, job_id: str) -> None:
        """Cancel a job: aborted in the engine if it runs here, settled as cancelled if it arrives later."""
        job = self.in_flight.cancel(job_id)
        if job is not None:
            log.info("cancelling job %s", job.job_id)
            self.preparation.cut_short(job)
            self.engine_loop.inbox.put(AbortJob(job.job_id))

    def _abort_lost(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            job = self.in_flight.get(job_id)
            if job is not None and job.abort_reason is None:
                job.abort_reason = "lost"
                self.preparation.cut_short(job)
                self.engine_loop.inbox.put(AbortJob(job_id))

    # ---- the cancel thread ----

    def _cancel_loop(self) -> None:
        last = None
        while not self.closed.is_set():
            try:
                if last is None:  # cancels from now on only
                    newest = self.cancels_redis.xrevrange(self.keys.cancels, count=1)
                    last = newest[0][0] if newest else "0-0"
                reply = self.cancels_redis.xread({self.keys.cancels: last}, count=CANCELS_PER_READ, block=1000)
            except UNAVAILABLE as e:
                log.warning("watching cancels failed (%s); retrying in 1 s", str(e) or type(e).__name__)
                self.closed.wait(1.0)
                self._cancels.reopen()
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    self.cancel(p.decode(fields.get(b"job_id", b"")))

    def _record_error(self, error: str) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            for job in self.in_flight.jobs():
                if job.source is None and not job.waiting:  # one read ahead never ran here
                    pipe.hset(self.keys.job(job.job_id), "last_error", error)
            pipe.execute()
        except redis.RedisError:
            pass
