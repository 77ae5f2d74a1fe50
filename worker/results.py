"""The writer thread: token deltas, results and heartbeats go to Redis here, never on the engine thread.

The engine thread puts whole steps' outputs in `outbox` and moves on. This thread coalesces each
completion's new tokens and text (the engine's, never decoded here) into one delta per `stream_interval`,
writes every finished job's result and acks its entry in one script call (first writer wins), and keeps
this worker's in-flight entries fresh.
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Callable

import redis

from producer import protocol as p
from producer.connection import UNAVAILABLE

from .consumer import Consumer, InFlight, Job
from .embeddings import JobEmbeddings
from .messages import JobHandedBack, JobStarted, StepOutputs
from .scripts import WorkerScripts

log = logging.getLogger("redline.worker")

STOP = object()  # put in the outbox after the engine's last output
MAX_DELTA_DUTY = 0.05  # share of the writer's time that token deltas may take (it shares the GIL)


@dataclass
class _Op:
    """One write: `command(pipe)` queues one command (or none); `after(reply)` runs once it is done."""

    command: Callable | None
    after: Callable | None = None


@dataclass
class _Stream:
    """What the writer knows of one completion's part of a job's token stream."""

    index: int = 0  # its tokens already written to the stream
    token_ids: list[int] = field(default_factory=list)  # not written yet
    text: str = ""  # the engine's text of token_ids, not written yet


class ResultWriter:
    def __init__(self, client: redis.Redis, keys: p.Keys, scripts: WorkerScripts, consumer: Consumer,
                 in_flight: InFlight, settings, metrics, on_lost: Callable[[list[str]], None]) -> None:
        self.redis, self.keys, self.scripts, self.consumer = client, keys, scripts, consumer
        self.in_flight, self.settings, self.metrics, self.on_lost = in_flight, settings, metrics, on_lost
        self.give_up_at: float | None = None  # set when the worker stops: no retrying writes past it
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, dict[int, _Stream]] = {}  # job id -> completion index -> its stream
        self.ending: set[str] = set()  # jobs whose last pieces are pending: written with their results
        self.heartbeat_every = max(settings.claim_timeout / 4, 0.05)

    # ---- the thread ----

    def run(self) -> None:
        next_flush = next_heartbeat = time.monotonic()
        stopping = False
        while not stopping:
            now = time.monotonic()
            wait = next_heartbeat - now
            if any(s.token_ids or s.text for streams in self.streams.values() for s in streams.values()):
                wait = min(wait, next_flush - now)
            items = self._take(max(wait, 0))
            stopping = STOP in items
            finished = [i for i in items if i is not STOP and self._collect(i)]
            now = time.monotonic()
            deltas_due = now >= next_flush or stopping
            if finished or deltas_due:
                self._flush(finished, deltas_due)
            if deltas_due:
                # at most MAX_DELTA_DUTY of this thread's time on deltas: many streams, fewer flushes
                spent = time.monotonic() - now
                next_flush = now + max(self.settings.stream_interval, spent / MAX_DELTA_DUTY)
            if now >= next_heartbeat:
                self._heartbeat()
                next_heartbeat = now + self.heartbeat_every

    def _take(self, timeout: float) -> list:
        try:
            items = [self.outbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self.outbox.get_nowait())
            except queue.Empty:
                return items

    def _collect(self, item) -> bool:
        """Record new tokens; return True for an item that ends a job."""
        if not isinstance(item, StepOutputs):
            return True
        for out in item.outputs:
            job = self.in_flight.get(out.request_id)
            # a job of another source has no token stream; a job not streamed gets its completions whole
            if job is not None and job.source is None and (job.spec.stream or out.finished):
                self._pend(job.job_id, out, whole=not job.spec.stream)
        return any(out.finished for out in item.outputs)

    def _pend(self, job_id: str, out, whole: bool) -> None:
        """Add each completion's new tokens and text (whole: all of them, for a job not streamed) to what
        its stream has pending."""
        streams = self.streams.setdefault(job_id, {})
        for c in out.outputs:
            token_ids, text = (c.token_ids, c.text or "") if whole else (c.new_token_ids, c.new_text)
            if token_ids or text:
                stream = streams.get(c.index) or streams.setdefault(c.index, _Stream())
                stream.token_ids += token_ids
                stream.text += text
        if out.finished:
            self.ending.add(job_id)

    # ---- writing ----

    def _flush(self, finished_items: list, deltas: bool) -> None:
        """One pipelined round trip: pending deltas (if due, and always those of jobs ending now but
        completion 0's, which ends the stream with the result), then every finished job."""
        ops: list[_Op] = []
        pending = [(job_id, c, s) for job_id, streams in self.streams.items() if deltas or job_id in self.ending
                   for c, s in streams.items() if (s.token_ids or s.text) and not (c == 0 and job_id in self.ending)]
        self.ending.clear()
        if pending:  # every delta in one script call: one command to send, not one per job
            keys, data = zip(*(self._delta(job_id, c, stream) for job_id, c, stream in pending))
            ops.append(_Op(lambda pipe: self.scripts.append_deltas(keys=keys, args=data, client=pipe)))
        for item in finished_items:
            ops += self._finish_ops(item)
        if ops:
            self._execute(ops)

    def _delta(self, job_id: str, completion: int, stream: _Stream, **final) -> tuple[str, str]:
        """(token stream key, JSON of the delta) for a completion's pending tokens and text."""
        job = self.in_flight.get(job_id)
        delta = p.TokenDelta(index=stream.index, token_ids=stream.token_ids, text=stream.text, completion=completion,
                             attempt=job.attempt if job else 1, **final)
        stream.index += len(stream.token_ids)
        stream.token_ids, stream.text = [], ""
        return self.keys.tokens(job_id), delta.model_dump_json()

    def _finish_ops(self, item) -> list:
        if isinstance(item, StepOutputs):
            ops = []
            for out in item.outputs:
                if out.finished:
                    job = self.in_flight.get(out.request_id)
                    if job is None:
                        continue
                    try:
                        ops.append(self._engine_finish_op(job, out))
                    except Exception as e:  # noqa: BLE001 - this job's own text or logprobs could not be built
                        log.warning("job %s: its result could not be built (%s); it fails", job.job_id, e)
                        error = f"its result could not be built: {type(e).__name__}: {e}"
                        ops.append(self._finish_op(job, p.FAILED, *p.final_args(job.job_id, p.FAILED, error)))
            return ops
        job = item.job
        if isinstance(item, JobStarted):  # the engine took a job of another source, which records that (Celery's)
            return [_Op(None, lambda reply: job.source.started(job))]
        if isinstance(item, JobHandedBack):
            return [self._hand_back_op(job)]
        result, end = p.final_args(job.job_id, item.status, item.error)
        return [self._finish_op(job, item.status, result, end)]

    def _engine_finish_op(self, job: Job, out):
        self.metrics.observe_finished(out)
        first = self.streams.pop(job.job_id, {}).get(0, _Stream())  # completion 0's last piece ends the stream
        if out.finish_reason == "abort" and job.abort_reason in ("lost", "handback"):
            if job.abort_reason == "handback":
                return self._hand_back_op(job)
            return _Op(None, lambda reply: self._done(job))
        if out.error is not None:  # the engine failed this request alone (its own data raised)
            status, error = p.FAILED, p.clean_error(out.error)
        elif out.finish_reason == "abort":
            status, error = p.CANCELLED, "cancelled while running"
        else:
            status, error = p.SUCCEEDED, None
        _, end = self._delta(job.job_id, 0, first, finished=True, status=status, finish_reason=out.finish_reason,
                             error=error)
        handed = job.handed_at or job.admitted_at
        queue_s = job.queue_s + max(handed - job.admitted_at, 0)
        timings = p.Timings(
            queue_s=round(queue_s, 6),
            ttft_s=round(out.first_token_time - out.arrival_time, 6) if out.first_token_time else None,
            e2e_s=round(queue_s + (out.finished_time or time.monotonic()) - out.arrival_time, 6))
        if isinstance(out, JobEmbeddings):
            result = p.JobResult(
                job_id=job.job_id, status=status, finish_reason=out.finish_reason, error=error,
                usage=p.Usage(prompt_tokens=len(out.prompt_token_ids), cached_tokens=out.num_cached_tokens),
                timings=timings, embeddings=out.embeddings, attempts=job.attempt, worker=self.settings.worker_name)
            return self._finish_op(job, status, result.model_dump_json(), end)
        completions = getattr(out, "outputs", None) or []
        outputs = None
        if len(completions) > 1:
            outputs = [p.Completion(index=c.index, text=c.text or "", token_ids=c.token_ids,
                                    finish_reason=c.finish_reason, logprobs=c.logprobs,
                                    cumulative_logprob=c.cumulative_logprob) for c in completions]
        num_generated = sum(len(c.token_ids) for c in completions) or len(out.token_ids)
        result = p.JobResult(
            job_id=job.job_id, status=status, text=out.text or "",
            token_ids=out.token_ids, finish_reason=out.finish_reason,
            error=error, usage=p.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=num_generated,
                                       cached_tokens=out.num_cached_tokens),
            timings=timings, logprobs=out.logprobs,
            cumulative_logprob=getattr(out, "cumulative_logprob", None), outputs=outputs,
            prompt_logprobs=prompt_logprobs_entries(out, job.spec.sampling.prompt_logprobs if job.spec else None),
            attempts=job.attempt, worker=self.settings.worker_name)
        return self._finish_op(job, status, result.model_dump_json(), end)

    def _hand_back_op(self, job: Job):
        if job.source is not None:
            return _Op(None, lambda reply: (job.source.hand_back(job), self._done(job)))
        ks, args = [self.keys.job(job.job_id), job.stream], [job.job_id, job.entry_id]
        return _Op(lambda pipe: self.scripts.handback(keys=ks, args=args, client=pipe), lambda reply: self._done(job))

    def _finish_op(self, job: Job, status: str, result: str, end: str):
        if job.source is not None:  # another source keeps its jobs' results itself (Celery's result backend)
            def stored(reply) -> None:
                if job.source.finish(job, status, result):
                    self.metrics.job_completed(status, source=job.source.name)
                self._done(job)
            return _Op(None, stored)

        def after(written) -> None:
            if written:
                self.metrics.job_completed(status)
            self._done(job)
        return _Op(lambda pipe: self.scripts.finish_job(self.keys, job.job_id, job.stream, job.entry_id, status, result,
                                                        end, self.settings.result_ttl, client=pipe), after)

    def _done(self, job: Job) -> None:
        self.streams.pop(job.job_id, None)
        self.in_flight.pop(job.job_id)

    def _execute(self, ops: list) -> None:
        """Run the ops in one pipeline, retrying while Redis is unreachable until `give_up_at` (every op
        is idempotent except a delta's XADD, which a retry after a partial write can repeat)."""
        while True:
            pipe = self.redis.pipeline(transaction=False)
            for op in ops:
                if op.command is not None:
                    op.command(pipe)
            try:
                replies = pipe.execute() if len(pipe) else []
                break
            except UNAVAILABLE as e:  # a lost connection, or a cluster failing over
                left = None if self.give_up_at is None else self.give_up_at - time.monotonic()
                if left is not None and left <= 0:
                    # nothing was acked: the entries stay pending and another worker will reclaim them
                    log.error("Redis unreachable while stopping (%s); leaving %d writes undone", e, len(ops))
                    return
                log.warning("writing results failed (%s); retrying in 1 s", e)
                time.sleep(1.0 if left is None else min(1.0, left))
        replies = iter(replies)
        for op in ops:
            reply = next(replies) if op.command is not None else None
            if op.after is not None:
                op.after(reply)

    def _heartbeat(self) -> None:
        self.metrics.heartbeat()
        if not len(self.in_flight):
            return
        try:
            lost = self.consumer.heartbeat(self.in_flight)
        except UNAVAILABLE as e:
            log.warning("heartbeat failed: %s", str(e) or type(e).__name__)
            return
        if lost:
            log.warning("%d jobs were taken over by other workers (this worker stalled past the claim "
                        "timeout); stopping them here", len(lost))
            self.on_lost(lost)


def prompt_logprobs_entries(out, num_top: int | None) -> list[dict] | None:
    """The engine's prompt logprobs as the wire carries them (protocol.JobResult.prompt_logprobs): one entry
    per prompt token, naming the token, with its num_top best; None where the job did not ask for them."""
    scored = getattr(out, "prompt_logprobs", None)
    if scored is None:
        return None
    texts = out.prompt_token_texts or [None] * len(out.prompt_token_ids)
    entries = [{"token_id": out.prompt_token_ids[0], "token": texts[0], "logprob": None, "rank": None,
                "top_logprobs": []}]
    for token_id, text, entry in zip(out.prompt_token_ids[1:], texts[1:], scored[1:]):
        best = sorted(entry.items(), key=lambda item: -item[1].logprob)[:num_top or 0]
        entries.append({"token_id": token_id, "token": text, "logprob": entry[token_id].logprob,
                        "rank": entry[token_id].rank,
                        "top_logprobs": [{"token_id": t, "token": lp.decoded_token, "logprob": lp.logprob,
                                          "rank": lp.rank} for t, lp in best]})
    return entries
