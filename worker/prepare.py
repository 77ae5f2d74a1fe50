"""A job's host work before the engine thread takes it: its structured-output grammar compiled, its images
decoded and preprocessed. It runs on a few threads of its own, beside the sources' threads, so that a job
slow to prepare (a large schema, large images) delays no other job: each job enters the engine when its
own preparation ends, and one with nothing to prepare goes straight there.

A job in preparation is still in flight: pending in Redis, its engine room taken, cancellable (passed on at
once, as cancelled), and handed back at the drain deadline if its preparation has not ended by then.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from engine.inputs.images import has_images
from engine.sampling.params import check_field, constraint

from .consumer import Job

log = logging.getLogger("redline.worker")

# jobs prepared at once: llguidance and PIL hold no GIL while they compile and decode, so each thread is a core
PREPARE_THREADS = 4


class Preparation:
    """Prepares jobs on PREPARE_THREADS threads and passes each on with `deliver` once it is ready."""

    def __init__(self, engine, deliver: Callable[[Job], None]) -> None:
        self.engine, self._deliver = engine, deliver
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[int, Job] = {}  # in preparation, by id(): a job is passed on once, by whoever takes it
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def submit(self, job: Job) -> None:
        """Prepare `job` (from any thread), or pass it on now when it has nothing to prepare."""
        if not (self._compiles(job) or self._has_images(job)):
            self._deliver(job)
            return
        with self._lock:
            self._jobs[id(job)] = job
            if len(self._threads) < PREPARE_THREADS:
                thread = threading.Thread(target=self._serve, name=f"redline-prepare-{len(self._threads)}",
                                          daemon=True)  # a decode under way never holds the process's exit
                self._threads.append(thread)
                thread.start()
        self._queue.put(job)

    def cut_short(self, job: Job) -> None:
        """Pass a job in preparation on now (it was cancelled); its preparation ends unheeded."""
        with self._lock:
            mine = self._jobs.pop(id(job), None) is job
        if mine:
            self._deliver(job)

    def take_all(self) -> list[Job]:
        """The jobs still in preparation, which will not be passed on: the caller hands them back."""
        with self._lock:
            jobs = list(self._jobs.values())
            self._jobs.clear()
        return jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job.abort_reason is None:  # a job cancelled while it waited needs nothing prepared
                    self._prepare(job)
            except Exception as e:  # noqa: BLE001 - a job can fail only itself
                log.exception("preparing job %s failed", job.job_id)
                job.start_error = job.start_error or f"could not start: {type(e).__name__}: {e}"
            finally:
                with self._lock:
                    mine = self._jobs.pop(id(job), None) is job
                if mine:
                    self._deliver(job)

    def _prepare(self, job: Job) -> None:
        if self._has_images(job):
            try:
                job.prompt = self.engine.encode_chat([m.model_dump() for m in job.spec.messages])
            except ValueError as e:
                job.start_error = str(e)
            except Exception as e:  # noqa: BLE001 - a template or image processor error is the job's problem
                log.exception("the images of job %s could not be prepared", job.job_id)
                job.start_error = f"could not start: {type(e).__name__}: {e}"
        if self._compiles(job) and job.start_error is None:
            # the compile check the readers left out (the job's sampling is checked whole once it passes), then
            # the compile into the engine's cache, each within its budget
            name, value = constraint(job.spec.sampling)
            try:
                check_field(name, value)
            except ValueError as e:
                job.start_error = str(e)
                return
            compile_grammar = getattr(self.engine, "compile_grammar", None)
            if compile_grammar is not None:
                compile_grammar(job.spec.sampling)

    def _compiles(self, job: Job) -> bool:
        return job.spec is not None and constraint(job.spec.sampling) is not None

    def _has_images(self, job: Job) -> bool:
        spec = job.spec
        return (spec is not None and spec.messages is not None and getattr(self.engine, "images", None) is not None
                and has_images([m.model_dump() for m in spec.messages]))
