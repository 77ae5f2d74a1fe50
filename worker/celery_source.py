"""A Celery queue as a second source of jobs for the worker's engine.

Celery producers keep their code: `app.send_task("redline.generate", kwargs={...}, queue=Q)`, broker and
result backend on the worker's Redis, then `.get()`. With `--celery-queue Q` the worker consumes Q through
kombu's Redis transport beside its own streams, into the same engine, taking room from the same `Capacity`,
and stores each task's states through Celery's own result backend: STARTED once the engine takes the job,
then SUCCESS (the JobResult as a dict), FAILURE (`JobFailed` with the job's error) or REVOKED (revoked or
expired). Neither the message format nor the result format is written here: kombu and Celery do both.

At least once: kombu keeps a delivered message in an unacked set until it is acked, here only after the
task's final state is stored. While this worker holds a message it stamps the delivery afresh (kombu's own
`QoS.append`), so only the messages of a worker unheard of for `celery_visibility_timeout` go back to the
queue (kombu's `restore_visible`, which every consumer runs). The unacked set is this queue's own, so
Celery workers of other queues on the same Redis keep their own visibility timeouts.

Revokes (`AsyncResult.revoke()`) come as broadcasts on Celery's control mailbox, read by kombu's pidbox
`Node`: a task not started yet ends REVOKED when a worker takes it, a running one is aborted in the engine.

One thread owns the kombu connection: it reads tasks (one at a time, while the engine has room), serves the
mailbox, stamps and acks. The writer thread stores the STARTED and final states and hands acks back to it.
"""
from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol
from urllib.parse import quote, urlsplit, urlunsplit

from producer import protocol as p

from .celery_transport import MAX_BODY_BYTES_OPTION, BadMessage, Transport
from .consumer import Job

log = logging.getLogger("redline.worker")

TASK_NAME = "redline.generate"
EMBED_TASK_NAME = "redline.embed"  # kwargs {"input": text(s) or token ids, "dimensions": N}: an embedding model's
EMBED_KWARGS = ("input", "dimensions", "priority", "deadline_s")
JOB_ID_PREFIX = "celery-"  # a task's job id in the engine, the logs and its JobResult: celery-<task id>
POLL_S = 0.02  # the thread comes round at least this often: acks, room for a held task, stopping
RESTORE_EVERY_S = 1.0  # how often an idle thread has kombu look for dead workers' messages to put back
# kombu's BRPOP waits this long in Redis. A message it takes while the worker stops reading is put back by
# kombu, so the thread waits one out before it says it reads no more (it delays a worker's exit this long).
BRPOP_TIMEOUT_S = 0.1
BACKEND_RETRIES = 10  # Celery retries a failed result store this often (with backoff); then the task is requeued


class JobSink(Protocol):
    """What a source of jobs needs of the worker (`Worker` implements it): room in the engine, the count of
    jobs in flight, a way into the engine, cancels, and whether the worker stops."""

    stopping: threading.Event  # set: hand over no more jobs
    closed: threading.Event  # set: every result is written; the source may end

    def take_room(self, n: int) -> int:
        """Room in the engine for up to `n` jobs; returns how many got it."""

    def hold(self, job: Job) -> bool:
        """Count the job in flight (cancels reach it from now on); False if a job of its id is in flight."""

    def release(self, job_id: str) -> None:
        """Stop counting a held job that never reached the engine."""

    def start_job(self, job: Job) -> None:
        """Hand a held job, its room taken, to the engine."""

    def cancel(self, job_id: str) -> None:
        """Cancel a job held here: aborted in the engine if it runs, ended as cancelled if it has not started."""


class JobFailed(Exception):
    """What `.get()` raises in a producer for a job that failed; its message is the job's error."""


@dataclass
class CeleryTask(Job):
    """A job delivered as a Celery task message; its message is acked once its final state is stored."""

    task_id: str = ""
    message: object = None  # the kombu message
    expires: datetime | None = None  # Celery's expires: not started by then, it ends REVOKED without running


def celery_app(url: str, settings):
    """The Celery app a worker consumes and stores results with: JSON only, results kept `result_ttl`,
    unacked messages under keys of this queue's own, bodies of at most `max_job_bytes`."""
    from celery import Celery

    unacked = unacked_key(settings.celery_queue)
    timeout = settings.celery_visibility_timeout
    app = Celery("redline", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        accept_content=["json"], result_accept_content=["json"], task_serializer="json", result_serializer="json",
        result_expires=settings.result_ttl, result_backend_always_retry=True,
        result_backend_max_retries=BACKEND_RETRIES,
        broker_transport_options={
            "visibility_timeout": timeout, "unacked_key": unacked, "unacked_index_key": f"{unacked}_index",
            # a worker killed while it restores others' messages holds this lock no longer than the timeout
            "unacked_mutex_key": f"{unacked}_mutex", "unacked_mutex_expire": max(round(timeout), 1),
            "unacked_restore_throttle": round(RESTORE_EVERY_S / POLL_S),  # one idle poll in this many looks
            "polling_interval": BRPOP_TIMEOUT_S,  # the Redis transport's BRPOP timeout
            MAX_BODY_BYTES_OPTION: settings.max_job_bytes})  # a compressed body decompresses no further
    return app


def unacked_key(celery_queue: str) -> str:
    """The hash where kombu keeps the queue's delivered, unacked messages (its index and lock beside it)."""
    return f"redline:celery:{celery_queue}:unacked"


def with_password(url: str, password: str | None) -> str:
    """The URL with `password` in it, unless it has one of its own (which wins, as for the worker's client)."""
    parts = urlsplit(url)
    if not password or "@" in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=f":{quote(password, safe='')}@{parts.netloc}"))


def priority_level(message_priority) -> int:
    """redline's priority level for a Celery message priority. kombu's Redis transport serves 0 first and 9
    last, in steps (0-2, 3-5, 6-8, 9): 0-2 is level 2, 3-5 level 1, the rest and unset the default, 0."""
    if not isinstance(message_priority, int):
        return 0
    return 2 if message_priority <= 2 else 1 if message_priority <= 5 else 0


def job_spec(body, message_priority, max_job_bytes: int, task: str = TASK_NAME) -> p.JobSpec:
    """The job a `redline.generate` (or `redline.embed`) task asks for; ValueError saying why for one that
    cannot run."""
    try:
        args, kwargs, _embed = body
    except (TypeError, ValueError):
        raise ValueError("the message body is not Celery's (args, kwargs, embed): send it with Celery 4 or later "
                         "(task protocol 2)") from None
    if args:
        raise ValueError(f"{task} takes keyword arguments only (send_task(..., kwargs={{...}})); "
                         f"got {len(args)} positional")
    if not isinstance(kwargs, dict):
        raise ValueError("the task's kwargs are not a mapping")
    if kwargs.get("stream"):
        raise ValueError("stream is not available through Celery: .get() returns the whole result")
    fields = {**kwargs, "stream": False}
    if task == EMBED_TASK_NAME:
        unknown = sorted(set(kwargs) - set(EMBED_KWARGS))
        if unknown or "input" not in kwargs:
            raise ValueError(f"{task} takes the kwargs {', '.join(EMBED_KWARGS)} (input required); got {sorted(kwargs)}")
        fields = {k: v for k, v in kwargs.items() if k != "input"}
        fields.update(embed=p.embed_inputs(kwargs["input"]), stream=False)
    fields.setdefault("priority", priority_level(message_priority))
    raw = json.dumps(fields)
    if len(raw) > max_job_bytes:
        raise ValueError(f"the job is {len(raw):,} bytes; this worker takes at most {max_job_bytes:,} (max_job_bytes)")
    try:
        return p.JobSpec.model_validate_json(raw, context=p.AT_WORKER)
    except p.ValidationError as e:
        raise ValueError(f"invalid job: {p.describe_validation_error(e)}") from None


def _time(value) -> datetime | None:
    """An `eta` or `expires` header as an aware datetime (Celery sends ISO 8601; naive is taken as UTC)."""
    from celery.utils.time import maybe_iso8601

    moment = maybe_iso8601(value)
    if moment is not None and moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment


class _Commands(dict):
    """The mailbox commands served; any other (Flower's inspect calls, say) is answered, not logged as an error."""

    def __missing__(self, method):
        return lambda state, **arguments: {"error": f"redline workers do not serve {method!r}"}


class CelerySource:
    """Serves one Celery queue into a worker's engine (see the module's docstring)."""

    name = "celery"  # the `source` label of the job metrics

    def __init__(self, settings, metrics, sink: JobSink) -> None:
        s = settings
        if not s.redis_url:
            raise ValueError("--celery-queue needs the Redis URL its producers use (--redis-url)")
        self.sink, self.settings, self.metrics = sink, s, metrics
        self.app = celery_app(with_password(s.redis_url, s.redis_password), s)
        self.queue = self.app.amqp.queues[s.celery_queue]  # declared as Celery's producers declare it
        self.hostname = f"redline@{s.worker_name}"  # this worker's name on Celery's control mailbox
        self.reading_done = threading.Event()  # set once no more tasks go to the engine
        self._unacked: dict[str, object] = {}  # delivery tag → message: delivered, not yet acked or requeued
        self._held: list[CeleryTask] = []  # delivered while the engine had no room; next in line
        self._settle: queue.SimpleQueue = queue.SimpleQueue()  # (message, True: ack | False: requeue)
        self._next_stamp = 0.0
        self._reads_end: float | None = None  # once it stops reading: when a BRPOP sent before has returned
        self._errors: tuple = ()

    # ---- the thread ----

    def run(self) -> None:
        """Read tasks while the worker reads; serve revokes and acks until everything is written."""
        try:
            with self.app.connection_for_read(transport=Transport) as conn:
                self._errors = conn.connection_errors
                consumer = self.app.amqp.TaskConsumer(conn.channel(), queues=[self.queue],
                                                      callbacks=[self._on_task], on_decode_error=self._on_undecodable)
                node = self.app.control.mailbox.Node(self.hostname, channel=conn.channel(), handlers=_Commands(
                    revoke=self._on_revoke, ping=lambda state, **arguments: {"ok": "pong"}))
                node.listen()
                consumer.consume()
                log.info("worker %s also serving Celery queue %r (task %s)", self.settings.worker_name,
                         self.queue.name, TASK_NAME)
                self._serve(conn, consumer)
        finally:  # after a failure too, so that the engine loop ends
            self.reading_done.set()
        # leaving the connection put back what is still unacked: results not stored in time run elsewhere

    def _serve(self, conn, consumer) -> None:
        w, credit = self.sink, None
        while not (w.closed.is_set() and self.reading_done.is_set()):
            try:
                self._settle_messages()
                if not w.stopping.is_set():
                    self._hand_over_held()
                    # one message beyond those held: a task that finds no room waits here, not in a socket
                    wanted = len(self._unacked) + (0 if self._held else 1)
                    if wanted != credit:
                        consumer.qos(prefetch_count=wanted)
                        credit = wanted
                elif self._reads_end is None:
                    self._stop_reading(consumer)
                elif time.monotonic() >= self._reads_end:
                    self.reading_done.set()
                self._stamp_deliveries()
                conn.drain_events(timeout=POLL_S)
            except socket.timeout:
                pass
            except BadMessage as bad:
                self._on_bad_message(bad, consumer.channel)
            except self._errors as e:
                log.warning("Celery queue %r: Redis failed (%s); retrying in 1 s", self.queue.name,
                            str(e) or type(e).__name__)
                w.closed.wait(1.0)
        self._settle_messages()

    def _hand_over_held(self) -> None:
        """Give held tasks to the engine while it has room; one past its expiry ends REVOKED instead."""
        while self._held:
            job = self._held[0]
            if job.expires is not None and job.expires <= datetime.now(timezone.utc):
                self._held.pop(0)
                self.sink.release(job.job_id)
                self._settle_now(job.message, job.task_id, p.EXPIRED,
                                 f"expired at {job.expires.isoformat()} before it started")
            elif self.sink.take_room(1):
                self.sink.start_job(self._held.pop(0))
            else:
                return

    def _stop_reading(self, consumer) -> None:
        """The worker drains: read no more tasks; those held go back to the queue."""
        consumer.cancel()
        self._reads_end = time.monotonic() + BRPOP_TIMEOUT_S + 2 * POLL_S
        for job in self._held:
            self.sink.release(job.job_id)
            self._settle.put((job.message, False))
        self._held = []

    def _settle_messages(self) -> None:
        """Ack (or requeue) what the writer and the reads settled; on a Redis error, retried next time round.
        While it stops reading, requeues wait until its last BRPOP is over (that BRPOP would take them)."""
        later = []
        while True:
            try:
                message, ack = self._settle.get_nowait()
            except queue.Empty:
                break
            if not ack and self.sink.stopping.is_set() and not self.reading_done.is_set():
                later.append((message, ack))
                continue
            try:
                message.ack() if ack else message.requeue()
            except self._errors:
                self._settle.put((message, ack))
                raise
            self._unacked.pop(message.delivery_tag, None)
        for item in later:
            self._settle.put(item)

    def _stamp_deliveries(self) -> None:
        """Stamp every held message as delivered now, so no live worker's task goes back to the queue."""
        now = time.monotonic()
        if now < self._next_stamp:
            return
        self._next_stamp = now + self.settings.celery_visibility_timeout / 4
        for message in list(self._unacked.values()):
            message.channel.qos.append(message, message.delivery_tag)

    # ---- messages (on the thread, from drain_events) ----

    def _on_task(self, body, message) -> None:
        """A task message kombu decoded from JSON: settled here if it cannot run, else on to the engine."""
        if message.delivery_tag in self._unacked:  # put back by a worker that thought this one dead: runs here
            log.info("Celery task %s came back while it runs here; the running copy's ack covers it",
                     (message.headers or {}).get("id"))
            return
        self._unacked[message.delivery_tag] = message
        headers = message.headers or {}
        redelivered = bool(message.delivery_info.get("redelivered"))
        self.metrics.job_received(source=self.name)
        if redelivered:
            self.metrics.job_redelivered(source=self.name)
        task_id = headers.get("id")
        if not isinstance(task_id, str) or not task_id:
            log.warning("dropped a message on Celery queue %r that names no task id", self.queue.name)
            self._settle.put((message, True))
            return
        try:
            self._admit(task_id, headers, body, message, redelivered)
        except Exception as e:  # a task can fail only itself
            log.exception("Celery task %s could not start", task_id)
            self._settle_now(message, task_id, p.FAILED, f"could not start: {type(e).__name__}: {e}")

    def _admit(self, task_id: str, headers: dict, body, message, redelivered: bool) -> None:
        """Settle a task that cannot run; line the others up for the engine."""
        from celery import states

        if headers.get("task") not in (TASK_NAME, EMBED_TASK_NAME):
            from celery.exceptions import NotRegistered

            error = (f"task {headers.get('task')!r} is not registered: redline workers run only {TASK_NAME!r} and "
                     f"{EMBED_TASK_NAME!r}")
            self._settle_now(message, task_id, p.FAILED, error, NotRegistered(error))
            return
        try:
            spec = job_spec(body, message.properties.get("priority"), self.settings.max_job_bytes, headers["task"])
            eta = _time(headers.get("eta"))
            if eta is not None and eta > datetime.now(timezone.utc):
                raise ValueError(f"{TASK_NAME} runs when a worker takes it: send it without eta or countdown")
        except ValueError as e:
            log.info("Celery task %s fails: %s", task_id, e)
            self._settle_now(message, task_id, p.FAILED, str(e))
            return
        if redelivered and self.app.backend.get_state(task_id) in states.READY_STATES:
            log.info("Celery task %s came back after its result was stored; acked without running", task_id)
            self._settle.put((message, True))
            return
        job = CeleryTask(JOB_ID_PREFIX + task_id, self.queue.name, message.delivery_tag, spec,
                         attempt=2 if redelivered else 1, source=self, task_id=task_id, message=message,
                         expires=_time(headers.get("expires")))
        if not self.sink.hold(job):
            log.info("Celery task %s was sent again while it runs here; this copy is acked without running", task_id)
            self._settle.put((message, True))
            return
        if job.abort_reason == "cancel":  # revoked before it came
            self.sink.release(job.job_id)
            self._settle_now(message, task_id, p.CANCELLED, "revoked before it started")
            return
        self._held.append(job)
        self._hand_over_held()

    def _on_undecodable(self, message, exc) -> None:
        """A message kombu would not decode: not JSON (a pickle is refused unread) or broken. Its task fails
        when its headers (JSON, read without the body) name one; otherwise it is dropped."""
        from kombu.exceptions import ContentDisallowed

        self._unacked[message.delivery_tag] = message
        self.metrics.job_received(source=self.name)
        if isinstance(exc, ContentDisallowed):
            error = f"refused a message of content type {message.content_type!r}: redline accepts JSON only"
        else:
            error = p.clean_error(f"could not decode the message: {exc}")
        task_id = (message.headers or {}).get("id")
        if isinstance(task_id, str) and task_id:
            log.warning("Celery task %s fails: %s", task_id, error)
            self._settle_now(message, task_id, p.FAILED, error)
        else:
            log.warning("dropped a message on Celery queue %r: %s", self.queue.name, error)
            self._settle.put((message, True))

    def _on_bad_message(self, bad: BadMessage, task_channel) -> None:
        """A message kombu could not read, already off its queue: its task fails if it names one, else it is
        dropped."""
        error = p.clean_error(bad.error)
        if bad.channel is not task_channel:
            log.warning("dropped a message on Celery's control mailbox: %s", error)
            return
        self.metrics.job_received(source=self.name)
        if bad.task_id is None:
            log.warning("dropped a message on Celery queue %r: %s", self.queue.name, error)
        elif self._store(bad.task_id, p.FAILED, error=error):
            log.warning("Celery task %s fails: %s", bad.task_id, error)
            self.metrics.job_completed(p.FAILED, source=self.name)

    def _on_revoke(self, state, task_id, **options) -> dict:
        """Celery's revoke, terminate or not: a task not started ends REVOKED, a running one is aborted."""
        task_ids = [task_id] if isinstance(task_id, str) else list(task_id or [])
        for tid in task_ids:
            job_id = JOB_ID_PREFIX + str(tid)
            held = next((job for job in self._held if job.job_id == job_id), None)
            if held is None:
                self.sink.cancel(job_id)
                continue
            self._held.remove(held)
            self.sink.release(job_id)
            self._settle_now(held.message, held.task_id, p.CANCELLED, "revoked before it started")
        return {"ok": f"tasks {', '.join(map(str, task_ids))} flagged as revoked"}

    def _settle_now(self, message, task_id: str, status: str, error: str, exc: Exception | None = None) -> None:
        """Store the final state of a task that ends without running, then ack its message."""
        stored = self._store(task_id, status, error=p.clean_error(error), exc=exc)
        if stored:
            self.metrics.job_completed(status, source=self.name)
        self._settle.put((message, stored))

    # ---- results (the writer thread, for the jobs it finishes) ----

    def started(self, job: CeleryTask) -> None:
        """The engine took the job: the task's state becomes STARTED."""
        try:
            self.app.backend.mark_as_started(job.task_id, hostname=self.hostname)
        except Exception as e:  # only a state on the way: the final one is what counts
            log.warning("could not mark Celery task %s started: %s", job.task_id, e)

    def finish(self, job: CeleryTask, status: str, result: str) -> bool:
        """Store the job's final state (`result`: the JobResult's JSON); its message is acked once stored,
        else put back on the queue for another try."""
        if status == p.SUCCEEDED:
            stored = self._store(job.task_id, status, result=json.loads(result))
        else:
            stored = self._store(job.task_id, status, error=json.loads(result)["error"])
        self._settle.put((job.message, stored))
        return stored

    def hand_back(self, job: CeleryTask) -> None:
        """The worker stops before the job ends: its message goes back to the queue."""
        self._settle.put((job.message, False))

    def _store(self, task_id: str, status: str, result: dict | None = None, error: str | None = None,
               exc: Exception | None = None) -> bool:
        backend = self.app.backend  # one per thread (Celery keeps it thread-local)
        try:
            if status == p.SUCCEEDED:
                backend.mark_as_done(task_id, result)
            elif status == p.FAILED:
                backend.mark_as_failure(task_id, exc or JobFailed(error))
            else:  # cancelled or expired: Celery's REVOKED, as its own workers store a revoked or expired task
                backend.mark_as_revoked(task_id, reason=error)
            return True
        except Exception as e:
            log.error("could not store the result of Celery task %s (%s); its message goes back to the queue",
                      task_id, e)
            return False
