"""The `redline` command: one entry point, one subcommand per job.

Each subcommand lives with the package it belongs to and is registered here by
`register(subparsers)`; imports are deferred so `redline submit` never loads torch.

A user's mistake (a bad value, an unreachable Redis, a missing file) ends in one line on stderr and a
non-zero exit; anything else is a bug and keeps its traceback. `--debug` or REDLINE_DEBUG=1 shows the
traceback of every error.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import NoReturn

# subcommand name -> module that defines register(subparsers)
SUBCOMMANDS = {
    "worker": "worker.__main__",
    "demo": "worker.demo",
    "submit": "producer.cli",
    "result": "producer.cli",
    "status": "producer.cli",
    "cancel": "producer.cli",
    "dlq": "producer.cli",
    "batch": "worker.batch_cli",
    "bench": "worker.bench",
    "serve": "producer.gateway.cli",
    "schema": "producer.schema",
}
MAX_ERROR_CHARS = 500
EXIT_BAD_USAGE = 2
EXIT_UNAVAILABLE = 1
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"]+", re.IGNORECASE)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("redline")
    except PackageNotFoundError:
        return "unknown (not installed)"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line on stderr (not the usage), with exit code 2."""

    def error(self, message: str) -> NoReturn:
        message = message.removeprefix("argument ")
        self.exit(EXIT_BAD_USAGE, one_line(f"{self.prog}: {message} (see {self.prog} --help)") + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="redline", description="LLM batch generation over Redis")
    parser.add_argument("--version", action="version", version=f"redline {version()}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (also REDLINE_DEBUG=1)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in dict.fromkeys(SUBCOMMANDS.values()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name):
                continue  # subcommand not built yet
            raise
        module.register(subparsers)
    for name, sub in subparsers.choices.items():
        if name != "bench":  # bench passes its arguments on whole, and takes --debug itself
            sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an error")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if args.debug or os.environ.get("REDLINE_DEBUG", "") not in ("", "0"):
            raise
        described = describe_user_error(e, getattr(args, "redis_url", None))
        if described is None:
            raise  # a bug: its traceback is what a report needs
        message, code = described
        print(one_line(f"redline {args.command}: {message}"), file=sys.stderr)
        return code


def describe_user_error(e: Exception, redis_url: str | None) -> tuple[str, int] | None:
    """(what to tell the user, exit code) for the errors a user can cause; None for a bug."""
    import redis
    from pydantic import ValidationError
    from redis.exceptions import MovedError, RedisClusterException

    from producer.cli import UsageError
    from producer.connection import redact_url
    from producer.protocol import describe_validation_error

    where = f" at {redact_url(redis_url)}" if redis_url else ""
    if isinstance(e, UsageError):
        return str(e), e.exit_code
    if isinstance(e, redis.AuthenticationError):
        return (f"Redis{where} refused the login ({e}); check the user and password in the URL",
                EXIT_UNAVAILABLE)
    if isinstance(e, MovedError):  # a one-server URL naming a node of a Redis Cluster
        return (f"Redis{where} is a node of a Redis Cluster ({e}); use a redis+cluster:// URL", EXIT_BAD_USAGE)
    if isinstance(e, RedisClusterException) and "same key slot" not in str(e):  # no node answered, or no cluster
        return f"cannot use the Redis Cluster{where}: {e}", EXIT_UNAVAILABLE
    if isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
        return (f"cannot reach Redis{where} ({e}); check that it runs and the URL (--redis-url, REDIS_URL), "
                "or run `redline worker` here with no URL to start one", EXIT_UNAVAILABLE)
    if isinstance(e, ValidationError):
        return describe_validation_error(e), EXIT_BAD_USAGE
    if isinstance(e, (ConnectionError, TimeoutError)):
        return str(e), EXIT_UNAVAILABLE
    if isinstance(e, OSError):  # a file named wrong is bad usage; a port in use, the machine's state
        if e.filename is not None:
            return f"{e.strerror or e}: {e.filename}", EXIT_BAD_USAGE
        return str(e), EXIT_UNAVAILABLE
    if isinstance(e, ValueError):
        return str(e), EXIT_BAD_USAGE
    return None


def one_line(message: str) -> str:
    """The message with no password of a URL in it, on one line, at most MAX_ERROR_CHARS long."""
    from producer.connection import redact_url

    text = " ".join(URL.sub(lambda m: redact_url(m.group(0)), message).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 1] + "…"


if __name__ == "__main__":
    sys.exit(main())
