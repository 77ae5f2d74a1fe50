"""An OpenAI Batch API input file run through a queue: the batch's job ids, its files and its runner.

The line format is `producer.batch_format`; the `redline batch` command, with its local mode (an
embedded Redis and a worker in the same process), is `worker.batch_cli`. Each input line becomes one
job; the output has one line per input line, in input order. A bad line becomes an error line; it
never stops the batch.

A batch resumes: its job ids derive from the input's content (and model and queue), so a rerun keeps
the lines already in the output, collects the jobs still in Redis and submits only the rest. The output
file is always the finished prefix of the input, in order; results are awaited in completion order.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

from . import protocol as p
from .batch_format import BatchLine, load_json, mark_repeated_ids, output_line, parse_line
from .client import build_job, cancel_call

SUBMIT_CHUNK = 500
POLL_S = 5.0  # every unfinished job's status is also read this often: feed entries can be trimmed away


class BatchError(Exception):
    """A mistake the user must fix; the message is one line."""


@dataclass
class Batch:
    """The parsed lines of one input and the id of each line, stable across reruns."""

    lines: list[BatchLine]
    line_ids: list[str]

    @classmethod
    def from_lines(cls, lines: list[str], batch_id: str, endpoint: str | None = None,
                   adapters: tuple[str, ...] = ()) -> "Batch":
        """endpoint: every line must ask for it; adapters: LoRA adapter names `model` may give (`parse_line`)."""
        parsed = [parse_line(raw, endpoint, adapters) for raw in lines]
        mark_repeated_ids(parsed)
        return cls(parsed, [f"{batch_id}-{i}" for i in range(len(lines))])


def batch_id(content: bytes, scope: str) -> str:
    """The same input in the same scope (queue, or local model) gets the same id: a rerun finds its jobs."""
    return hashlib.sha256(content + b"\0" + scope.encode()).hexdigest()[:16]


# ---- files ----

def read_input(path: str) -> tuple[bytes, list[str]]:
    """The input's bytes and its non-blank lines; a file that is not JSONL at all is refused."""
    try:
        with open(path, "rb") as f:
            content = f.read()
    except OSError as e:
        raise BatchError(f"cannot read {path}: {e.strerror or e}") from None
    return content, input_lines(content, path)


def input_lines(content: bytes, name: str) -> list[str]:
    """The non-blank lines of an input named `name`; BatchError if it is not JSONL at all."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise BatchError(f"{name} is not UTF-8 text; give a JSONL file, one request object per line") from None
    lines = [raw for raw in text.split("\n") if raw.strip()]
    if not lines:
        raise BatchError(f"{name} is empty; give a JSONL file, one request object per line")
    if not any(_is_object(raw) for raw in lines):
        raise BatchError(f"{name} is not JSONL: no line is a JSON object; give one request object per line")
    return lines


def _is_object(raw: str | bytes) -> bool:
    value, error = load_json(raw)
    return error is None and isinstance(value, dict)


def read_kept(path: str, batch: Batch) -> tuple[int, int]:
    """Check the output an earlier run of this batch left; return (lines kept, how many are errors).

    A last line cut mid-write is dropped (that line is redone); the output of another input is refused.
    """
    if os.path.isdir(path):
        raise BatchError(f"output {path} is a directory; give a file path with -o")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0, 0
    except OSError as e:
        raise BatchError(f"cannot read {path}: {e.strerror or e}") from None
    rows = data.split(b"\n")
    cut = rows.pop()  # what follows the last newline: a line cut mid-write, or nothing
    # how each output line of this batch begins: output_line's first two keys, as json.dumps writes them
    starts = [json.dumps({"id": f"batch_req_{i}", "custom_id": line.custom_id})[:-1].encode()
              for i, line in zip(batch.line_ids, batch.lines)]
    ours = len(rows) + bool(cut) <= len(starts) and all(
        row.startswith(start) and _is_object(row) for row, start in zip(rows, starts))
    if ours and cut:
        ours = cut.startswith(starts[len(rows)]) or starts[len(rows)].startswith(cut)
    if not ours:
        raise BatchError(f"{path} holds results of another input (or --model/--queue); pick another -o or delete it")
    if cut:
        os.truncate(path, len(data) - len(cut))
    return len(rows), sum(json.loads(row).get("error") is not None for row in rows)


# ---- running ----

@dataclass
class Summary:
    written: int  # output lines on disk, this run's and earlier runs'
    succeeded: int  # of this run's
    failed: int
    stopped: str | None = None  # why the run ended before every line was written
    unfinished: int = 0  # jobs without a result when it stopped
    cancelled: bool = False  # and whether they were cancelled


class _Run:
    """The jobs of one batch in Redis, and the in-order output written from their results."""

    def __init__(self, batch: Batch, client, output, kept: int, model: str, on_finished: Callable) -> None:
        self.batch, self.client, self.output, self.model = batch, client, output, model
        self.on_finished = on_finished
        self.redis, self.keys = client.redis, client.keys
        self.waiting: dict[str, int] = {}  # job id -> line index, for jobs without a result yet
        self.done: dict[int, dict] = {}  # output lines finished after a gap, not yet written
        self.next_line = kept
        self.succeeded = self.failed = 0
        self.feed_id = "0-0"  # the last entry of the results feed already seen

    def start(self) -> None:
        """Collect what earlier runs left in Redis, then submit the lines that have no job yet."""
        newest = self.redis.xrevrange(self.keys.results, count=1)
        self.feed_id = newest[0][0] if newest else "0-0"
        attempts: dict[int, int] = {}
        for i in range(self.next_line, len(self.batch.lines)):
            if self.batch.lines[i].error is not None:
                self._finish(i, None)
            else:
                attempts[i] = 1
        todo: dict[int, str] = {}
        while attempts:  # a cancelled attempt (an interrupted run's) is followed by a fresh job
            job_ids = {i: self._job_id(i, n) for i, n in attempts.items()}
            pipe = self.redis.pipeline(transaction=False)
            for job_id in job_ids.values():
                pipe.hmget(self.keys.job(job_id), "status", "cancel", "result")
            cancelled = {}
            for (i, job_id), (status, cancel, raw) in zip(job_ids.items(), pipe.execute()):
                if status is None:
                    todo[i] = job_id
                elif status == p.CANCELLED.encode() or (cancel and not raw):
                    cancelled[i] = attempts[i] + 1
                elif raw:
                    self._finish(i, p.JobResult.model_validate_json(raw))
                else:
                    self.waiting[job_id] = i
            attempts = cancelled
        self._submit(todo)

    def _job_id(self, i: int, attempt: int) -> str:
        # a fresh id: workers remember cancelled ids and would cancel a job reusing one
        return self.batch.line_ids[i] if attempt == 1 else f"{self.batch.line_ids[i]}.{attempt}"

    def _submit(self, todo: dict[int, str]) -> None:
        jobs = []
        for i, job_id in todo.items():
            job = {**self.batch.lines[i].job, "job_id": job_id}
            try:
                build_job(**job)
            except ValueError as e:
                self._finish(i, None, str(e))
                continue
            jobs.append(job)
            self.waiting[job_id] = i
        for start in range(0, len(jobs), SUBMIT_CHUNK):
            self.client.submit_many(jobs[start:start + SUBMIT_CHUNK])

    def wait(self, timeout: float | None) -> None:
        """Until every job has a result: follow the results feed, and read every status now and then."""
        last_result = time.monotonic()
        next_poll = last_result + POLL_S
        while self.waiting:
            reply = self.redis.xread({self.keys.results: self.feed_id}, count=1000, block=1000)
            ready = {}
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self.feed_id = entry_id
                    ready[p.decode(fields.get(b"job_id", b""))] = None
            now = time.monotonic()
            if now >= next_poll:
                ready, next_poll = self.waiting, now + POLL_S
            if self._collect([job_id for job_id in ready if job_id in self.waiting]):
                last_result = now
            elif timeout is not None and now - last_result > timeout:
                raise TimeoutError(f"no job finished in {timeout:g} s")

    def _collect(self, job_ids: list[str]) -> int:
        """Finish the lines of those jobs that have a result; returns how many."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(self.keys.job(job_id), "status", "result")
        found, lost = 0, {}
        for job_id, (status, raw) in zip(job_ids, pipe.execute()):
            if raw:
                self._finish(self.waiting.pop(job_id), p.JobResult.model_validate_json(raw))
                found += 1
            elif status is None:  # Redis lost it (restarted empty): submit it again
                lost[self.waiting.pop(job_id)] = job_id
        self._submit(lost)
        return found

    def cancel(self) -> None:
        """Cancel every job still without a result."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in self.waiting:
            keys, args = cancel_call(self.keys, job_id)
            self.client.scripts.cancel(keys=keys, args=args, client=pipe)
        pipe.execute()

    def _finish(self, i: int, result, error: str | None = None) -> None:
        out = output_line(self.batch.lines[i], self.batch.line_ids[i], result, error, self.model)
        self.done[i] = out
        self.succeeded += out["error"] is None
        self.failed += out["error"] is not None
        self.on_finished(i)
        rows = []
        while self.next_line + len(rows) in self.done:
            rows.append(json.dumps(self.done[self.next_line + len(rows)]) + "\n")
        if rows:  # one write per run of ready lines: the file stays an in-order prefix
            self.output.write("".join(rows))
            self.output.flush()
            for _ in rows:
                del self.done[self.next_line]
                self.next_line += 1


def run_batch(batch: Batch, client, output, *, kept: int = 0, timeout: float | None = None,
              model: str = "redline", detach: bool = False, progress: bool = True,
              on_finished: Callable[[int], None] | None = None) -> Summary:
    """Run the lines past the first `kept` and append their output lines in order.

    Ctrl-C, `timeout` seconds without a result, or a Redis failure stop the run; its unfinished jobs
    are then cancelled unless `detach`. `on_finished(i)` is called as line i finishes, in any order.
    """
    import redis
    from tqdm.auto import tqdm

    with tqdm(total=len(batch.lines), initial=kept, desc="batch", unit="req", disable=not progress,
              file=sys.stderr) as bar:
        def finished(i: int) -> None:
            bar.update(1)
            if on_finished is not None:
                on_finished(i)

        run = _Run(batch, client, output, kept, model, finished)
        stopped = None
        try:
            run.start()
            run.wait(timeout)
        except KeyboardInterrupt:
            stopped = "interrupted"
        except TimeoutError as e:  # redis-py raises its own TimeoutError, a RedisError
            stopped = str(e)
        except redis.RedisError as e:
            stopped, detach = f"Redis failed: {str(e)[:200]}", True  # nothing to cancel through
    summary = Summary(run.next_line, run.succeeded, run.failed, stopped, len(run.waiting))
    if stopped and not detach and run.waiting:
        try:
            run.cancel()
            summary.cancelled = True
        except redis.RedisError:
            pass
    return summary
