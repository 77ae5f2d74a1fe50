"""The synchronous producer client. `AsyncClient` (producer.aio) has the same methods, awaited.

    c = Client("redis://localhost:6379/0", queue="default")
    job_id = c.submit(prompt="Hello", sampling={"max_tokens": 32})
    print(c.result(job_id, timeout=30).text)
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import redis

from . import protocol as p
from .connection import connect, redact_url  # noqa: F401  (redact_url: importable from here too)
from .scripts import ClientScripts, finish_keys


LOCAL_URL = "redis://localhost:6379/0"
URL_VARIABLES = ("REDLINE_REDIS_URL", "REDIS_URL")  # where a Redis URL is looked for, in this order


def find_url(given: str | None = None) -> str | None:
    """The Redis every command uses: `given` (--redis-url), else REDLINE_REDIS_URL, else REDIS_URL, else
    the embedded redis-server a worker on this machine published; None if there is none of them."""
    return given or next((os.environ[v] for v in URL_VARIABLES if os.environ.get(v)), None) or published_url()


def default_url(given: str | None = None) -> str:
    """`find_url`, else a Redis on localhost."""
    return find_url(given) or LOCAL_URL


def runtime_dir() -> Path:
    """Where workers publish their embedded redis-servers' URLs: $XDG_RUNTIME_DIR/redline, else a
    folder of this user's in the temporary directory."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "redline" if base else Path(tempfile.gettempdir()) / f"redline-{os.getuid()}"


def published_url() -> str | None:
    """The URL of the newest embedded redis-server still running that a worker here published."""
    folder = runtime_dir()
    try:
        st = folder.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return None  # a folder someone else could write to could point producers at their Redis
        files = list(folder.glob("redis-*.url"))
    except OSError:
        return None
    live = []
    for f in files:
        try:
            pid, mtime, url = int(f.stem.removeprefix("redis-")), f.stat().st_mtime, f.read_text().strip()
        except (OSError, ValueError):
            continue
        if _alive(pid):
            live.append((mtime, url))
        else:
            f.unlink(missing_ok=True)  # its worker was killed before it could remove it
    return max(live)[1] if live else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:  # gone, or a reused pid of another user's
        return False
    return True


# ---- helpers shared with the asyncio client: no I/O below this line until the class ----

def build_job(prompt: str | None = None, *, messages: list | None = None,
              prompt_token_ids: list[int] | None = None, sampling: dict | p.Sampling | None = None,
              job_id: str | None = None, priority: int = 0, deadline_s: float | None = None,
              stream: bool = True, embed: list[str] | list[list[int]] | None = None,
              dimensions: int | None = None, lora: str | None = None) -> tuple[str, int, str]:
    """Validate one job; return (job_id, priority, JSON of its JobSpec). Raises ValueError."""
    job_id = p.check_job_id(job_id) if job_id is not None else p.new_job_id()
    given = {"prompt": prompt, "messages": messages, "prompt_token_ids": prompt_token_ids,
             "sampling": sampling, "deadline_s": deadline_s, "embed": embed, "dimensions": dimensions,
             "lora": lora}
    fields = {k: v for k, v in given.items() if v is not None}
    if priority:
        fields["priority"] = priority
    if not stream:
        fields["stream"] = False
    try:
        spec = p.JobSpec(**fields)
    except p.ValidationError as e:
        raise ValueError(f"invalid job: {p.describe_validation_error(e)}") from None
    return job_id, spec.priority, spec.model_dump_json(exclude_unset=True)


def submit_call(keys: p.Keys, jobs: list[tuple[str, int, str]]) -> tuple[list[str], list]:
    """Keys and arguments of one SUBMIT script call for (job_id, priority, spec_json) triples."""
    streams = keys.all_jobs()
    args: list = []
    for job_id, priority, spec in jobs:
        args += [p.PRIORITIES.index(priority) + 1, job_id, spec]
    return streams + [keys.job(job_id) for job_id, _, _ in jobs], args


def job_kwargs(job: dict | p.JobSpec) -> dict:
    if isinstance(job, p.JobSpec):
        return job.model_dump(exclude_defaults=True)
    return dict(job)


def cancel_call(keys: p.Keys, job_id: str) -> tuple[list[str], list]:
    result, end = p.final_args(job_id, p.CANCELLED, "cancelled before it started")
    ks = finish_keys(keys, job_id, keys.cancels, *keys.all_jobs())
    return ks, [job_id, result, end, p.RESULT_TTL_S, p.RESULTS_FEED_MAXLEN]


def parse_status(job_id: str, fields: dict) -> p.JobStatus | None:
    if not fields or b"status" not in fields:
        return None
    error = None
    if fields.get(b"result"):
        error = json.loads(fields[b"result"]).get("error")
    return p.JobStatus(job_id=job_id, status=p.decode(fields[b"status"]),
                       attempts=int(fields.get(b"attempts", 0)),
                       worker=p.decode(fields[b"worker"]) if fields.get(b"worker") else None,
                       error=error or (p.decode(fields[b"last_error"]) if fields.get(b"last_error") else None))


def parse_delta(entry_id, fields: dict) -> p.TokenDelta:
    delta = p.TokenDelta.model_validate_json(fields[b"data"])
    delta.id = p.decode(entry_id)
    return delta


def deltas_from_result(result: p.JobResult) -> list[p.TokenDelta]:
    """What a reader gets when the token stream has expired but the result has not: each completion whole
    (as `outputs` has them, when n > 1), the first last with the final status."""
    attempt = max(result.attempts, 1)
    others = [p.TokenDelta(token_ids=c.token_ids, text=c.text, completion=c.index, attempt=attempt)
              for c in (result.outputs or [])[1:]]
    return others + [p.TokenDelta(token_ids=result.token_ids, text=result.text, attempt=attempt, finished=True,
                                  status=result.status, finish_reason=result.finish_reason, error=result.error)]


def parse_dead(entry_id, fields: dict) -> p.DeadLetter:
    f = {p.decode(k): v for k, v in fields.items()}
    return p.DeadLetter(id=p.decode(entry_id), job_id=p.decode(f.get("job_id", b"")),
                        stream=p.decode(f.get("stream", b"")), deliveries=int(f.get("deliveries", 0)),
                        error=p.decode(f.get("error", b"")),
                        job=p.decode(f["job"]) if f.get("job") else None)


def requeue_call(keys: p.Keys, dead: p.DeadLetter) -> tuple[list[str], list]:
    ks = [keys.dead, keys.job(dead.job_id), keys.tokens(dead.job_id), keys.done(dead.job_id), dead.stream]
    return ks, [dead.id, dead.job_id, dead.job or ""]


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


class Client:
    """Submit jobs to a queue and read their results, streams and status."""

    def __init__(self, url: str | None = None, queue: str = "default", *,
                 redis_client: redis.Redis | None = None) -> None:
        """url: redis://, rediss://, unix:// or, for a Redis Cluster, redis+cluster://HOST:PORT[,HOST:PORT...]
        (see producer.connection); None: `default_url()`."""
        self.url = url or default_url()
        # no socket timeout: result() and stream() block in Redis for as long as they are asked to
        self.redis = redis_client or connect(self.url, socket_timeout=None)
        self.keys = p.Keys(queue)
        self.scripts = ClientScripts(self.redis)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, prompt: str | None = None, **kwargs: Any) -> str:
        """Enqueue one job; return its id. A job id that exists already is not enqueued again.

        kwargs: messages, prompt_token_ids, sampling (dict or Sampling), job_id, priority (0-2,
        higher first), deadline_s (seconds after enqueue), stream (write token deltas); or, for an
        embedding model's worker, embed (a list of texts or token-id lists; the result's `embeddings`) and
        dimensions; lora: the name of a LoRA adapter the worker serves (`redline worker --lora NAME=PATH`).
        """
        job = build_job(prompt, **kwargs)
        keys, args = submit_call(self.keys, [job])
        self.scripts.submit(keys=keys, args=args)
        return job[0]

    def submit_many(self, jobs: Iterable[dict | p.JobSpec], chunk: int = 500) -> list[str]:
        """Enqueue many jobs, `chunk` per script call, pipelined; each job is a dict of `submit`'s
        arguments. All are validated before any is sent."""
        built = [build_job(**job_kwargs(job)) for job in jobs]
        pipe = self.redis.pipeline(transaction=False)
        for i in range(0, len(built), chunk):
            keys, args = submit_call(self.keys, built[i:i + chunk])
            self.scripts.submit(keys=keys, args=args, client=pipe)
        pipe.execute()
        return [job_id for job_id, _, _ in built]

    def result(self, job_id: str, timeout: float | None = None) -> p.JobResult:
        """Block until the job has a result (or raise TimeoutError after `timeout` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            raw = self.redis.hget(self.keys.job(job_id), "result")
            if raw:
                return p.JobResult.model_validate_json(raw)
            left = remaining(deadline)
            if left is not None and left <= 0:
                raise TimeoutError(f"job {job_id} has no result after {timeout} s")
            # BLMOVE onto the same list leaves the element for other waiters; wakes once it is pushed.
            done = self.keys.done(job_id)
            if self.redis.blmove(done, done, 0 if left is None else max(left, 0.01), "RIGHT", "LEFT") is None:
                raise TimeoutError(f"job {job_id} has no result after {timeout} s")

    def stream(self, job_id: str, after: str = "0-0", timeout: float | None = None) -> Iterator[p.TokenDelta]:
        """Yield token deltas as they are generated, ending with the `finished` one.

        A job with n > 1 yields every completion's deltas as they come, interleaved: `delta.completion` says
        whose (its index in the result's `outputs`), `delta.index` where its tokens go in that completion.
        Resume after a disconnect with `after=<the .id of the last delta you saw>`. A delta with
        `restart` set means the job started over on another worker: drop what you have (every completion's).
        """
        key = self.keys.tokens(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        if after == "0-0" and not self.redis.exists(key):
            raw = self.redis.hget(self.keys.job(job_id), "result")
            if raw:  # finished long ago: the token stream expired before the result did
                yield from deltas_from_result(p.JobResult.model_validate_json(raw))
                return
        while True:
            left = remaining(deadline)
            if left is not None and left <= 0:
                raise TimeoutError(f"job {job_id}: no new tokens within {timeout} s")
            block = 0 if left is None else max(int(left * 1000), 1)
            reply = self.redis.xread({key: after}, count=256, block=block)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    delta = parse_delta(entry_id, fields)
                    after = delta.id
                    yield delta
                    if delta.finished:
                        return

    def cancel(self, job_id: str) -> bool:
        """Cancel a queued or running job. False if it is unknown or already finished."""
        keys, args = cancel_call(self.keys, job_id)
        return bool(self.scripts.cancel(keys=keys, args=args))

    def status(self, job_id: str) -> p.JobStatus | None:
        """The job's current status, or None if the queue does not know it (or it expired)."""
        fields = self.redis.hmget(self.keys.job(job_id), "status", "attempts", "worker", "result", "last_error")
        names = (b"status", b"attempts", b"worker", b"result", b"last_error")
        return parse_status(job_id, {k: v for k, v in zip(names, fields) if v is not None})

    def dead_letters(self, count: int = 100) -> list[p.DeadLetter]:
        """The oldest `count` dead letters."""
        return [parse_dead(i, f) for i, f in self.redis.xrange(self.keys.dead, count=count)]

    def requeue(self, dead_ids: list[str] | None = None) -> int:
        """Put dead letters back on their streams as fresh jobs (all of them if no ids). Returns how many."""
        if dead_ids is None:
            letters = [parse_dead(i, f) for i, f in self.redis.xrange(self.keys.dead)]
        else:
            letters = [parse_dead(i, f) for d in dead_ids for i, f in self.redis.xrange(self.keys.dead, d, d)]
        n = 0
        for dead in letters:
            keys, args = requeue_call(self.keys, dead)
            n += int(self.scripts.requeue(keys=keys, args=args))
        return n
