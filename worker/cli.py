"""The `redline` command: one entry point, one subcommand per job.

Each subcommand lives with the package it belongs to and is registered here by
`register(subparsers)`; imports are deferred so `redline submit` never loads torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module that defines register(subparsers)
SUBCOMMANDS = {
    "worker": "worker.__main__",
    "demo": "worker.demo",
    "submit": "producer.cli",
    "dlq": "producer.cli",
    "batch": "producer.batch",
    "bench": "worker.bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="redline", description="LLM batch generation over Redis")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in dict.fromkeys(SUBCOMMANDS.values()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name):
                continue  # subcommand not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
