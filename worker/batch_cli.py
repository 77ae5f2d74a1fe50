"""`redline batch in.jsonl -o out.jsonl`: an OpenAI Batch API input file run through a queue.

The jobs go to the queue of the Redis every command finds (`producer.client.find_url`: --redis-url,
REDLINE_REDIS_URL / REDIS_URL, a `redline worker` on this machine); with none, or with --model, they
run here: an embedded Redis and a worker in this process (`worker.local`). Either way `producer.batch`
submits them and writes the output, and a rerun resumes an interrupted run.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
import uuid

from producer import Client
from producer import protocol as p
from producer.batch import Batch, BatchError, Summary, batch_id, read_input, read_kept, run_batch
from producer.client import find_url
from producer.connection import redact_url

from .local import local_worker

FIRST_LINE_START_BYTES = 64  # holds an output line's opening id: `{"id": "batch_req_<16 hex>-0"`
OUTPUT_BATCH_ID = re.compile(rb'\{"id": "batch_req_([0-9a-f]+)-0"')


def register(subparsers) -> None:
    parser = subparsers.add_parser("batch", help="run an OpenAI Batch API file (JSONL) through the queue")
    parser.add_argument("input", help="JSONL of requests to /v1/chat/completions or /v1/completions")
    parser.add_argument("-o", "--output", required=True,
                        help="JSONL of results, one per input line, in order; an unfinished one is resumed")
    parser.add_argument("--redis-url", default=None,
                        help="a queue with running workers; default: REDLINE_REDIS_URL / REDIS_URL, else the "
                             "embedded Redis of a `redline worker` on this machine, else run the jobs here")
    parser.add_argument("--queue", default="default", help="the queue to submit to (not when the jobs run here)")
    parser.add_argument("--model", default=None,
                        help="run the jobs here on this model, not on a queue's workers (default when no queue is "
                             "found: the tiny built-in random model)")
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop, as Ctrl-C does, when no job has finished for this many seconds")
    parser.add_argument("--detach", action="store_true",
                        help="on a queue: when stopped, leave unfinished jobs running; a rerun collects them")
    parser.add_argument("--fresh", action="store_true",
                        help="run every line again, not reusing the results of an earlier run of this input "
                             "(into a new -o)")
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
    if args.redis_url or not args.model:  # --model alone: run here, whatever queue there is
        args.redis_url = find_url(args.redis_url)  # the error handler names it
    if args.detach and not args.redis_url:
        raise BatchError("--detach needs a queue (--redis-url, REDIS_URL or a `redline worker` here): without "
                         "one the jobs run in this process and end with it")
    content, lines = read_input(args.input)
    scope = f"queue {args.queue}" if args.redis_url else f"local {args.model} {args.load_format}"
    batch = Batch.from_lines(lines, _batch_id(args, batch_id(content, scope)))
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
            print(f"redline batch: queue {args.queue!r} at {redact_url(args.redis_url)}", file=sys.stderr)
            with Client(args.redis_url, args.queue) as client:
                _say_reused(client, batch, kept)
                summary = run_batch(batch, client, output, **options)
        else:
            with local_worker(args.model, args.load_format, args.device,
                              say=lambda m: print(m, file=sys.stderr)) as local:
                with Client(local.url, local.queue) as client:
                    summary = run_batch(batch, client, output, model=args.model or "tiny-random", **options)
    summary.succeeded += kept - kept_errors
    summary.failed += kept_errors
    return summary, len(lines)


def _batch_id(args: argparse.Namespace, same_input: str) -> str:
    """The input's batch id; --fresh: a new one. A new id keeps the input's first half, so that a
    rerun into the same output resumes that run (its id is read back from the output's first line)."""
    half = len(same_input) // 2
    if args.fresh:
        if os.path.exists(args.output) and os.path.getsize(args.output) > 0:
            raise BatchError(f"--fresh runs every line again: give a new -o, or delete {args.output}")
        return same_input[:half] + uuid.uuid4().hex[:len(same_input) - half]
    earlier = _output_batch_id(args.output)
    return earlier if earlier and earlier[:half] == same_input[:half] else same_input


def _output_batch_id(path: str) -> str | None:
    """The batch id of the output's first line ({"id": "batch_req_<batch id>-0", ...}), if it has one."""
    try:
        with open(path, "rb") as f:
            start = f.read(FIRST_LINE_START_BYTES)
    except OSError:
        return None
    found = OUTPUT_BATCH_ID.match(start)
    return found.group(1).decode() if found else None


def _say_reused(client: Client, batch: Batch, kept: int) -> None:
    """One line when earlier runs of this input left results in the queue that this run takes."""
    pipe = client.redis.pipeline(transaction=False)
    for job_id in batch.line_ids[kept:]:
        pipe.hmget(client.keys.job(job_id), "status", "result")
    reused = sum(bool(raw) and status != p.CANCELLED.encode() for status, raw in pipe.execute())
    if reused:
        print(f"redline batch: reusing {reused} results of an earlier run of this input in queue "
              f"{client.keys.queue!r}; --fresh to run them again", file=sys.stderr)
