"""`redline batch in.jsonl -o out.jsonl`: an OpenAI Batch API input file run through the queue.

Each input line is a request `{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}`; each output line, in input order, is `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}` with a chat.completion or text_completion
body. A bad line becomes an error line; it never stops the batch.

A batch resumes: its job ids derive from the input's content (and model and queue), so a rerun keeps
the lines already in the output, collects the jobs still in Redis and submits only the rest. The output
file is always the finished prefix of the input, in order; results are awaited in completion order.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from . import protocol as p
from .client import build_job, cancel_call

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
SUBMIT_CHUNK = 500
POLL_S = 5.0  # every unfinished job's status is also read this often: feed entries can be trimmed away
# request body field -> wire sampling field
SAMPLING_FIELDS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
                   "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
                   "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos"}
# body fields not honoured yet -> the values that mean the same as leaving them out (null always does);
# honouring one is moving it to SAMPLING_FIELDS (and its output into output_line)
NOT_YET = {"n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,),
           "logprobs": (False,), "top_logprobs": (0,), "response_format": ({"type": "text"},),
           "stream": (False,), "logit_bias": ({},), "echo": (False,), "tools": ([],), "tool_choice": ("none",)}
INFORMATIONAL = {"model", "user", "metadata"}  # accepted and not used: the worker's model answers
INPUTS = {"messages", "prompt"}


class BatchError(Exception):
    """A mistake the user must fix; the message is one line."""


@dataclass
class BatchLine:
    custom_id: str | None
    url: str | None = None
    job: dict = field(default_factory=dict)
    error: str | None = None  # the line cannot run: why


@dataclass
class Batch:
    """The parsed lines of one input and the id of each line, stable across reruns."""

    lines: list[BatchLine]
    line_ids: list[str]

    @classmethod
    def from_lines(cls, lines: list[str], batch_id: str) -> "Batch":
        return cls([parse_line(raw) for raw in lines], [f"{batch_id}-{i}" for i in range(len(lines))])


def batch_id(content: bytes, scope: str) -> str:
    """The same input in the same scope (queue, or local model) gets the same id: a rerun finds its jobs."""
    return hashlib.sha256(content + b"\0" + scope.encode()).hexdigest()[:16]


def parse_line(raw: str) -> BatchLine:
    """One input line as a job for `Client.submit_many`, or the reason it cannot be one."""
    try:
        req = json.loads(raw)
    except json.JSONDecodeError as e:
        return BatchLine(None, error=f"line is not JSON: {e}")
    if not isinstance(req, dict):
        return BatchLine(None, error="line is not a JSON object")
    custom_id = req.get("custom_id")
    line = BatchLine(custom_id if isinstance(custom_id, str) else None, req.get("url"))
    body = req.get("body")
    if line.custom_id is None:
        line.error = "custom_id must be a string"
    elif req.get("method", "POST") != "POST":
        line.error = f"method must be POST, got {_shown(req.get('method'))}"
    elif line.url not in ENDPOINTS:
        line.error = f"url must be one of {', '.join(ENDPOINTS)}, got {_shown(line.url)}"
    elif not isinstance(body, dict):
        line.error = "body must be a JSON object"
    else:
        line.job, line.error = _job(line.url, body)
    return line


def _shown(value, limit: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_noop(value, noops: tuple) -> bool:
    # False == 0 in Python: a bool must match a bool (logprobs=0 asks for the sampled token's logprob)
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in noops)


def _job(url: str, body: dict) -> tuple[dict, str | None]:
    unknown = sorted(set(body) - set(SAMPLING_FIELDS) - set(NOT_YET) - INFORMATIONAL - INPUTS)
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        return {}, f"unsupported body fields: {', '.join(u[:30] for u in unknown[:5])}{more}"
    not_yet = [f"{name}={_shown(body[name])} is not supported yet (leave it out or use {_shown(noops[0])})"
               for name, noops in NOT_YET.items() if body.get(name) is not None and not _is_noop(body[name], noops)]
    if not_yet:
        return {}, "; ".join(not_yet)
    sampling = {wire: body[name] for name, wire in SAMPLING_FIELDS.items() if body.get(name) is not None}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    job: dict = {"sampling": sampling, "stream": False}
    if url == "/v1/chat/completions":
        if not isinstance(body.get("messages"), list):
            return {}, "a chat completion needs messages"
        job["messages"] = body["messages"]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            job["prompt"] = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            job["prompt_token_ids"] = prompt
        else:
            return {}, "a completion needs a prompt: a string or a list of token ids"
    return job, None


def output_line(line: BatchLine, request_id: str, result=None, error: str | None = None,
                model: str = "redline") -> dict:
    """The output line for one input line: its result, or an error."""
    out = {"id": f"batch_req_{request_id}", "custom_id": line.custom_id, "response": None, "error": None}
    error = error or line.error or (result.error if result is not None and not result.ok else None)
    if error is not None:
        out["error"] = {"code": getattr(result, "status", None) or "invalid_request", "message": error}
        return out
    usage = {"prompt_tokens": result.usage.prompt_tokens, "completion_tokens": result.usage.completion_tokens,
             "total_tokens": result.usage.prompt_tokens + result.usage.completion_tokens}
    if line.url == "/v1/chat/completions":
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "finish_reason": result.finish_reason}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason}
        kind = "text_completion"
    body = {"id": result.job_id, "object": kind, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage}
    out["response"] = {"status_code": 200, "request_id": result.job_id, "body": body}
    return out


# ---- files ----

def read_input(path: str) -> tuple[bytes, list[str]]:
    """The input's bytes and its non-blank lines; a file that is not JSONL at all is refused."""
    try:
        with open(path, "rb") as f:
            content = f.read()
        text = content.decode("utf-8")
    except OSError as e:
        raise BatchError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise BatchError(f"{path} is not UTF-8 text; give a JSONL file, one request object per line") from None
    lines = [raw for raw in text.split("\n") if raw.strip()]
    if not lines:
        raise BatchError(f"{path} is empty; give a JSONL file, one request object per line")
    if not any(_is_object(raw) for raw in lines):
        raise BatchError(f"{path} is not JSONL: no line is a JSON object; give one request object per line")
    return content, lines


def _is_object(raw: str | bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


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


# ---- the command ----

def register(subparsers) -> None:
    parser = subparsers.add_parser("batch", help="run an OpenAI Batch API file (JSONL) through the queue")
    parser.add_argument("input", help="JSONL of requests to /v1/chat/completions or /v1/completions")
    parser.add_argument("-o", "--output", required=True,
                        help="JSONL of results, one per input line, in order; an unfinished one is resumed")
    parser.add_argument("--redis-url", default=None,
                        help="a queue with running workers; default: run the jobs here (embedded Redis + worker)")
    parser.add_argument("--queue", default="default", help="with --redis-url: the queue to submit to")
    parser.add_argument("--model", default=None,
                        help="without --redis-url: the model to run (default: the tiny built-in random model)")
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop, as Ctrl-C does, when no job has finished for this many seconds")
    parser.add_argument("--detach", action="store_true",
                        help="with --redis-url: when stopped, leave unfinished jobs running; a rerun collects them")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        summary, total = _run(args)
    except BatchError as e:
        print(f"redline batch: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("redline batch: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    if summary.stopped is None:
        print(f"redline batch: {summary.succeeded} succeeded, {summary.failed} failed in "
              f"{time.perf_counter() - start:.1f} s; results in {args.output}", file=sys.stderr)
        return 0  # failed requests are results too: each has its error line in the output
    jobs = f"{summary.unfinished} unfinished jobs"
    fate = f"cancelled its {jobs}" if summary.cancelled else f"its {jobs} keep running" if summary.unfinished \
        else "no job is running"
    print(f"redline batch: {summary.stopped}; {summary.written} of {total} lines are in {args.output}; {fate}; "
          f"run the same command again to resume", file=sys.stderr)
    return 130 if summary.stopped == "interrupted" else 1


def _run(args: argparse.Namespace) -> tuple[Summary, int]:
    from producer import Client

    if args.detach and not args.redis_url:
        raise BatchError("--detach needs --redis-url: without it the jobs run in this process and end with it")
    content, lines = read_input(args.input)
    scope = f"queue {args.queue}" if args.redis_url else f"local {args.model} {args.load_format}"
    batch = Batch.from_lines(lines, batch_id(content, scope))
    kept, kept_errors = read_kept(args.output, batch)
    if kept:
        print(f"redline batch: resuming: {kept} of {len(lines)} lines are already in {args.output}",
              file=sys.stderr)
    try:
        output = open(args.output, "a")
    except OSError as e:
        raise BatchError(f"cannot write {args.output}: {e.strerror or e}") from None
    options = dict(kept=kept, timeout=args.timeout, detach=args.detach)
    with output:
        if args.redis_url:
            with Client(args.redis_url, args.queue) as client:
                summary = run_batch(batch, client, output, **options)
        else:
            from worker.local import local_worker
            with local_worker(args.model, args.load_format, args.device,
                              say=lambda m: print(m, file=sys.stderr)) as local:
                with Client(local.url, local.queue) as client:
                    summary = run_batch(batch, client, output, model=args.model or "tiny-random", **options)
    summary.succeeded += kept - kept_errors
    summary.failed += kept_errors
    return summary, len(lines)
