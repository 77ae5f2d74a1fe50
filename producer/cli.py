"""`redline submit` (one job from the shell), `redline result|status|cancel JOB_ID` (a job submitted
with --no-wait) and `redline dlq` (dead letters: list, requeue)."""
from __future__ import annotations

import argparse
import json
import sys

from . import protocol as p
from .client import Client, default_url


class UsageError(Exception):
    """A user's mistake that the `redline` command reports in one line: exit 2 (bad usage or value)
    or 1 (something asked for does not exist)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def register(subparsers) -> None:
    submit = subparsers.add_parser("submit", help="submit one job and print (or stream) its result")
    submit.add_argument("prompt", nargs="?", help="prompt text ('-' reads stdin)")
    given = submit.add_mutually_exclusive_group()
    given.add_argument("--chat", metavar="TEXT", help="one user message, through the model's chat template")
    given.add_argument("--messages", metavar="JSON", help='chat messages: [{"role": "user", "content": "..."}]')
    given.add_argument("--token-ids", metavar="IDS", help="prompt token ids, comma-separated")
    given.add_argument("--embed", metavar="TEXT", action="append",
                       help="embed this text (repeatable; an embedding model's worker): prints one JSON vector a line")
    submit.add_argument("--dimensions", type=int, help="with --embed: keep each vector's first N values, renormalised")
    s = submit.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int)
    s.add_argument("--temperature", type=float, help="0 is greedy")
    s.add_argument("--top-p", type=float)
    s.add_argument("--top-k", type=int)
    s.add_argument("--min-p", type=float)
    s.add_argument("--seed", type=int)
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", default=None)
    s.add_argument("--json-schema", metavar="SCHEMA",
                   help="structured output: the completion is JSON following this schema (its JSON text, or "
                        "@FILE to read it from a file)")
    s.add_argument("--regex", help="structured output: the completion matches this regular expression")
    s.add_argument("--choice", action="append", help="structured output: the completion is one of these strings "
                                                     "(repeatable)")
    submit.add_argument("--job-id", help="your id for the job; an id that exists is not enqueued again")
    submit.add_argument("--priority", type=int, default=0, help="0 (default), 1 or 2: higher runs first")
    submit.add_argument("--lora", help="run under this LoRA adapter of the worker's (its --lora NAME=PATH)")
    submit.add_argument("--deadline", type=float, help="seconds after which an unstarted job expires")
    submit.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    submit.add_argument("--no-wait", action="store_true",
                        help="print the job id and exit (then: redline result|status|cancel JOB_ID)")
    submit.add_argument("--timeout", type=float, default=None, help="seconds to wait for the result")
    submit.add_argument("--json", action="store_true", help="print the whole result as JSON")
    _connection(submit)
    submit.set_defaults(func=run_submit)

    result = subparsers.add_parser("result", help="wait for a job's result and print it")
    result.add_argument("job_id")
    result.add_argument("--timeout", type=float, default=None, help="seconds to wait (default: until it ends)")
    result.add_argument("--json", action="store_true", help="print the whole result as JSON")
    _connection(result)
    result.set_defaults(func=run_result)

    status = subparsers.add_parser("status", help="a job's status: queued, running, succeeded, ...")
    status.add_argument("job_id")
    status.add_argument("--json", action="store_true", help="print it as JSON")
    _connection(status)
    status.set_defaults(func=run_status)

    cancel = subparsers.add_parser("cancel", help="cancel a queued or running job")
    cancel.add_argument("job_id")
    _connection(cancel)
    cancel.set_defaults(func=run_cancel)

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
                        help="default: REDLINE_REDIS_URL / REDIS_URL, else the embedded redis-server of a "
                             "`redline worker` on this machine, else redis://localhost:6379/0")
    parser.add_argument("--queue", default="default")


def _client(args: argparse.Namespace) -> Client:
    args.redis_url = default_url(args.redis_url)  # the error handler names the Redis it could not reach
    return Client(args.redis_url, args.queue)


def _job(args: argparse.Namespace) -> dict:
    job: dict = {"job_id": args.job_id, "priority": args.priority, "deadline_s": args.deadline,
                 "stream": args.stream}
    sampling = {k: getattr(args, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                                              "stop", "ignore_eos", "json_schema", "regex", "choice")}
    if args.embed is not None:
        if args.prompt is not None or args.stream or any(v is not None for v in sampling.values()):
            raise UsageError("--embed takes no prompt, --stream or sampling flags")
        if args.lora is not None:
            raise UsageError("--embed takes no --lora")
        return {**job, "stream": False, "embed": args.embed, "dimensions": args.dimensions}
    if args.dimensions is not None:
        raise UsageError("--dimensions goes with --embed")
    if args.chat is not None:
        job["messages"] = [{"role": "user", "content": args.chat}]
    elif args.messages is not None:
        try:
            job["messages"] = json.loads(args.messages)
        except json.JSONDecodeError as e:
            raise UsageError(f"--messages is not JSON ({e}); give a list like "
                             '\'[{"role": "user", "content": "Hi"}]\'') from None
    elif args.token_ids is not None:
        try:
            job["prompt_token_ids"] = [int(t) for t in args.token_ids.replace(" ", "").split(",") if t]
        except ValueError:
            raise UsageError(f"--token-ids takes comma-separated integers, got {args.token_ids!r}") from None
    elif args.prompt is not None:
        job["prompt"] = sys.stdin.read() if args.prompt == "-" else args.prompt
    else:
        raise UsageError("give a prompt, --chat, --messages, --token-ids or --embed")
    if args.json_schema is not None and args.json_schema.startswith("@"):
        sampling["json_schema"] = _read_schema(args.json_schema[1:])
    job["sampling"] = {k: v for k, v in sampling.items() if v is not None}
    if args.lora is not None:
        job["lora"] = args.lora
    return job


def _read_schema(path: str) -> str:
    """The text of a --json-schema @FILE, at most a job's size (the wire schema then checks it)."""
    with open(path, "rb") as f:
        data = f.read(p.MAX_JOB_BYTES + 1)
    if len(data) > p.MAX_JOB_BYTES:
        raise UsageError(f"--json-schema file {path} is over {p.MAX_JOB_BYTES:,} bytes, a job's limit")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise UsageError(f"--json-schema file {path} is not UTF-8 text; give a JSON schema") from None


def run_submit(args: argparse.Namespace) -> int:
    job = _job(args)
    client = _client(args)
    job_id = client.submit(job.pop("prompt", None), **job)
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
            print(f"\nredline submit: {e} (job id {job_id})", file=sys.stderr)
            return 1
        print()
    return _print_result(client, job_id, args, text=not args.stream)


def _print_result(client: Client, job_id: str, args: argparse.Namespace, text: bool = True) -> int:
    """Wait for the result; print it (its text, or all of it as JSON); 1 if the job did not succeed."""
    try:
        result = client.result(job_id, timeout=args.timeout)
    except TimeoutError as e:
        print(f"redline {args.command}: {e} (job id {job_id})", file=sys.stderr)
        return 1
    if args.json:
        print(result.model_dump_json())
    elif result.embeddings is not None:
        for vector in result.embeddings:
            print(json.dumps(vector))
    elif text:
        print(result.text)
    if not result.ok:
        print(f"redline {args.command}: job {job_id} {result.status}: {result.error}", file=sys.stderr)
        return 1
    return 0


def _known_status(client: Client, job_id: str):
    status = client.status(job_id)
    if status is None:
        raise UsageError(f"no job {job_id!r} in queue {client.keys.queue!r} (a wrong id or queue, or its result "
                         "expired)", exit_code=1)
    return status


def run_result(args: argparse.Namespace) -> int:
    client = _client(args)
    _known_status(client, args.job_id)
    return _print_result(client, args.job_id, args)


def run_status(args: argparse.Namespace) -> int:
    status = _known_status(_client(args), args.job_id)
    if args.json:
        print(status.model_dump_json())
        return 0
    details = [f"attempt {status.attempts}" if status.attempts else "", f"worker {status.worker}" if status.worker else "",
               status.error or ""]
    print(f"{status.status}" + "".join(f"  {d}" for d in details if d))
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    client = _client(args)
    status = _known_status(client, args.job_id)
    if client.cancel(args.job_id):
        print(f"cancelled {args.job_id}")
        return 0
    now = client.status(args.job_id) or status
    raise UsageError(f"job {args.job_id} has already ended ({now.status}); nothing to cancel", exit_code=1)


def run_dlq(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "list":
        letters = client.dead_letters(args.count)
        if not letters and not args.json:
            print(f"no dead letters in queue {args.queue!r}")
        for dead in letters:
            if args.json:
                print(dead.model_dump_json())
            else:
                print(f"{dead.id}  job {dead.job_id}  deliveries {dead.deliveries}  {dead.error}")
        return 0
    if not args.ids and not args.all:
        raise UsageError("give dead-letter ids (from `redline dlq list`), or --all")
    n = client.requeue(None if args.all else args.ids)
    print(f"requeued {n} job(s)")
    return 0
