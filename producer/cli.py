"""`redline submit` (one job from the shell) and `redline dlq` (dead letters: list, requeue)."""
from __future__ import annotations

import argparse
import json
import sys

from .client import Client


def register(subparsers) -> None:
    submit = subparsers.add_parser("submit", help="submit one job and print (or stream) its result")
    submit.add_argument("prompt", nargs="?", help="prompt text ('-' reads stdin)")
    given = submit.add_mutually_exclusive_group()
    given.add_argument("--chat", metavar="TEXT", help="one user message, through the model's chat template")
    given.add_argument("--messages", metavar="JSON", help='chat messages: [{"role": "user", "content": "..."}]')
    given.add_argument("--token-ids", metavar="IDS", help="prompt token ids, comma-separated")
    s = submit.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int)
    s.add_argument("--temperature", type=float, help="0 is greedy")
    s.add_argument("--top-p", type=float)
    s.add_argument("--top-k", type=int)
    s.add_argument("--min-p", type=float)
    s.add_argument("--seed", type=int)
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", default=None)
    submit.add_argument("--job-id", help="your id for the job; an id that exists is not enqueued again")
    submit.add_argument("--priority", type=int, default=0, help="0 (default), 1 or 2: higher runs first")
    submit.add_argument("--deadline", type=float, help="seconds after which an unstarted job expires")
    submit.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    submit.add_argument("--no-wait", action="store_true", help="print the job id and exit")
    submit.add_argument("--timeout", type=float, default=None, help="seconds to wait for the result")
    submit.add_argument("--json", action="store_true", help="print the whole result as JSON")
    _connection(submit)
    submit.set_defaults(func=run_submit)

    dlq = subparsers.add_parser("dlq", help="dead-lettered jobs: list or requeue")
    dlq.add_argument("action", choices=["list", "requeue"])
    dlq.add_argument("ids", nargs="*", help="dead-letter entry ids to requeue (default with --all: every one)")
    dlq.add_argument("--all", action="store_true", help="requeue every dead letter")
    dlq.add_argument("--count", type=int, default=100, help="list at most this many")
    dlq.add_argument("--json", action="store_true", help="one JSON object per line")
    _connection(dlq)
    dlq.set_defaults(func=run_dlq)


def _connection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=None,
                        help="default: REDLINE_REDIS_URL / REDIS_URL, else redis://localhost:6379/0")
    parser.add_argument("--queue", default="default")


def _job(args: argparse.Namespace) -> dict:
    job: dict = {"job_id": args.job_id, "priority": args.priority, "deadline_s": args.deadline,
                 "stream": args.stream}
    if args.chat is not None:
        job["messages"] = [{"role": "user", "content": args.chat}]
    elif args.messages is not None:
        job["messages"] = json.loads(args.messages)
    elif args.token_ids is not None:
        job["prompt_token_ids"] = [int(t) for t in args.token_ids.replace(" ", "").split(",") if t]
    elif args.prompt is not None:
        job["prompt"] = sys.stdin.read() if args.prompt == "-" else args.prompt
    else:
        raise ValueError("give a prompt, --chat, --messages or --token-ids")
    sampling = {k: getattr(args, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                                              "stop", "ignore_eos")}
    job["sampling"] = {k: v for k, v in sampling.items() if v is not None}
    return job


def run_submit(args: argparse.Namespace) -> int:
    try:
        job = _job(args)
        client = Client(args.redis_url, args.queue)
        job_id = client.submit(job.pop("prompt", None), **job)
    except ValueError as e:
        print(f"redline submit: {e}", file=sys.stderr)
        return 2
    if args.no_wait:
        print(job_id)
        return 0
    if args.stream:
        try:
            for delta in client.stream(job_id, timeout=args.timeout):
                if delta.restart:
                    print("\n[the job restarted on another worker]", file=sys.stderr)
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        except TimeoutError as e:
            print(f"\nredline submit: {e}", file=sys.stderr)
            return 1
        print()
    try:
        result = client.result(job_id, timeout=args.timeout)
    except TimeoutError as e:
        print(f"redline submit: {e} (job id {job_id})", file=sys.stderr)
        return 1
    if args.json:
        print(result.model_dump_json())
    elif not args.stream:
        print(result.text)
    if not result.ok:
        print(f"redline submit: job {job_id} {result.status}: {result.error}", file=sys.stderr)
        return 1
    return 0


def run_dlq(args: argparse.Namespace) -> int:
    client = Client(args.redis_url, args.queue)
    if args.action == "list":
        for dead in client.dead_letters(args.count):
            if args.json:
                print(dead.model_dump_json())
            else:
                print(f"{dead.id}  job {dead.job_id}  deliveries {dead.deliveries}  {dead.error}")
        return 0
    if not args.ids and not args.all:
        print("redline dlq requeue: give dead-letter ids, or --all", file=sys.stderr)
        return 2
    n = client.requeue(None if args.all else args.ids)
    print(f"requeued {n} job(s)")
    return 0
