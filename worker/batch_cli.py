"""`redline batch in.jsonl -o out.jsonl`: an OpenAI Batch API input file run through a queue.

With --redis-url the jobs go to that queue's workers; without it they run here: an embedded Redis and
a worker in this process (`worker.local`). Either way `producer.batch` submits them and writes the
output, and a rerun resumes an interrupted run.
"""
from __future__ import annotations

import argparse
import sys
import time

from producer import Client
from producer.batch import Batch, BatchError, Summary, batch_id, read_input, read_kept, run_batch

from .local import local_worker


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
            with local_worker(args.model, args.load_format, args.device,
                              say=lambda m: print(m, file=sys.stderr)) as local:
                with Client(local.url, local.queue) as client:
                    summary = run_batch(batch, client, output, model=args.model or "tiny-random", **options)
    summary.succeeded += kept - kept_errors
    summary.failed += kept_errors
    return summary, len(lines)
