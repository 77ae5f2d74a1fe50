"""The engine thread: adds prepared jobs to the engine, aborts cancelled ones, steps it, and hands each
step's outputs to the writer. It never waits on Redis: its inbox brings `RunJob`, `AbortJob` and `Wake`
messages, its outbox (the writer's) takes what it produced, and it publishes the engine's room (`Capacity`).
"""
from __future__ import annotations

import logging
import queue
import time

from engine.sampling.params import SamplingParams
from producer import protocol as p

from .consumer import InFlight, Job
from .embeddings import EmbeddingJobs
from .flow import Capacity, Drain
from .messages import AbortJob, JobEnded, JobHandedBack, JobStarted, RunJob, StepOutputs
from .prepare import Preparation
from .reader import Reader
from .stats import StatsLog

log = logging.getLogger("redline.worker")

SHUTDOWN_GRACE_S = 2.0  # past the drain deadline, the last writes may retry this long before the worker exits
IDLE_WAIT_S = 0.5  # an idle engine thread looks at the drain this often


class EngineLoop:
    """Drives one engine until the drain ends; `run()` raises what the engine raised."""

    def __init__(self, engine, in_flight: InFlight, preparation: Preparation, capacity: Capacity, drain: Drain,
                 outbox, metrics, reader: Reader, sources: list, loras: dict | None = None) -> None:
        self.engine, self.in_flight, self.preparation = engine, in_flight, preparation
        self.capacity, self.drain, self.outbox, self.metrics = capacity, drain, outbox, metrics
        self.reader, self.sources = reader, sources  # the sources of jobs: done once they hand over no more
        self.loras = loras or {}  # the LoRA adapters jobs may name (`--lora NAME=PATH`): LoRARequests by name
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.embeddings = EmbeddingJobs()  # embedding jobs: one engine request per input
        self.stats = StatsLog()

    def run(self) -> None:
        engine = self.engine
        self.capacity.publish(engine.num_free_slots())
        while True:
            received = self._apply_messages(block=not engine.has_unfinished())
            if engine.has_unfinished():
                # the writer needs the finished jobs' outputs and the token deltas of jobs that stream
                result = engine.step(finished_only=True)
                self.metrics.observe_step(result.stats)
                self.stats.observe(result)
                outputs = self.embeddings.collect(result.outputs)
                if outputs:
                    self.outbox.put(StepOutputs(outputs))
            elif self._drained():
                return
            self.capacity.publish(engine.num_free_slots(), received)
            if self.drain.overdue():
                self._hand_back_running()
            self.stats.maybe_log(self.reader.queue_waiting)

    def _drained(self) -> bool:
        """Stopping, with nothing left for the engine, and the sources done (or past waiting for them: one
        may hang in a call to a Redis that stopped answering)."""
        if not self.drain.stopping.is_set() or not self.inbox.empty():
            return False
        if len(self.preparation) and not self.drain.overdue():
            return False
        if self.reader.done.is_set() and all(s.reading_done.is_set() for s in self.sources):
            return True
        return time.monotonic() >= self.drain.deadline + SHUTDOWN_GRACE_S

    def _apply_messages(self, block: bool) -> int:
        """Add new jobs to the engine and abort cancelled ones; returns how many jobs arrived."""
        received = 0
        try:
            message = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return 0
        while True:
            if isinstance(message, RunJob):
                received += 1
                self._start(message.job)
            elif isinstance(message, AbortJob):
                self._abort(message.job_id)
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return received

    def _start(self, job: Job) -> None:
        if job.abort_reason == "cancel":
            self.outbox.put(JobEnded(job, p.CANCELLED, "cancelled before it started"))
            return
        if job.abort_reason is not None:
            self.in_flight.pop(job.job_id)
            return
        if self.drain.overdue():
            self.outbox.put(JobHandedBack(job))
            return
        if job.start_error is not None:
            self.outbox.put(JobEnded(job, p.FAILED, job.start_error))
            return
        spec = job.spec
        try:
            if spec.embed is not None:
                self.embeddings.start(self.engine, job.job_id, spec.embed, spec.dimensions)
            else:
                self._add_request(job)
        except ValueError as e:
            self.outbox.put(JobEnded(job, p.FAILED, str(e)))
            return
        except Exception as e:  # a template or tokenizer error is the job's problem, not the worker's
            log.exception("job %s could not start", job.job_id)
            self.outbox.put(JobEnded(job, p.FAILED, f"could not start: {type(e).__name__}: {e}"))
            return
        if job.source is not None:
            self.outbox.put(JobStarted(job))
        job.handed_at = time.monotonic()
        self.metrics.observe_queue_time(job.queue_s + job.handed_at - job.admitted_at)

    def _add_request(self, job: Job) -> None:
        spec = job.spec
        prompt = spec.prompt_token_ids or spec.prompt
        if job.prompt is not None:
            prompt, job.prompt = job.prompt, None
        elif spec.messages is not None:
            prompt = self.engine.encode_chat([m.model_dump() for m in spec.messages])
        # checked at admission (the constraint's compile check on the preparation threads): not again here
        params = SamplingParams.from_checked(spec.sampling.model_dump(exclude_none=True))
        lora = None
        if spec.lora is not None:
            lora = self.loras.get(spec.lora)
            if lora is None:
                raise ValueError(f"this worker serves no LoRA adapter {spec.lora!r}; it serves: "
                                 f"{', '.join(self.loras) or 'none (start it with --lora NAME=PATH)'}")
        self.engine.add_request(prompt, params, request_id=job.job_id, stream=spec.stream, lora_request=lora)

    def _hand_back_running(self) -> None:
        for job in self.preparation.take_all():
            self.outbox.put(JobHandedBack(job))
        for job in self.in_flight.jobs():
            if job.abort_reason is None and job.handed_at is not None:
                job.abort_reason = "handback"
                self._abort(job.job_id)

    def _abort(self, job_id: str) -> None:
        if not self.embeddings.abort(self.engine, job_id):
            self.engine.abort(job_id)
