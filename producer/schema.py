"""The wire contract as JSON Schema, for producers in any language that write to Redis directly.

    python -m producer.schema -o docs/wire-schema.json     (or: redline schema -o docs/wire-schema.json)

Generated from the pydantic models of `producer.protocol`; a test checks the file in the repository
against them, so it is never stale.
"""
from __future__ import annotations

import argparse
import json
import sys

from pydantic.json_schema import models_json_schema

from . import protocol as p

DESCRIPTION = (
    "redline's queue, queue Q. Enqueue: XADD redline:{Q}:jobs:<priority> * job_id <id> job <JSON of JobSpec> "
    "(priority 0, 1 or 2; the entry is a StreamEntry). Result: once the list redline:{Q}:done:<id> has an "
    "element, HGET redline:{Q}:job:<id> result is the JSON of JobResult (kept 24 h). Token deltas: the stream "
    "redline:{Q}:tokens:<id>, each entry's field data the JSON of a TokenDelta. Keys and rules: docs/queue.md.")


def wire_schema() -> dict:
    """A JSON Schema document whose $defs are the job (JobSpec), its stream entry, its result (JobResult)
    and its token deltas (TokenDelta)."""
    _, schema = models_json_schema([(p.JobSpec, "validation"), (p.JobResult, "serialization"),
                                    (p.TokenDelta, "serialization")], ref_template="#/$defs/{model}")
    defs = schema["$defs"]
    defs["StreamEntry"] = {
        "title": "StreamEntry", "type": "object", "required": ["job_id", "job"], "additionalProperties": False,
        "description": "The fields of one entry of a job stream redline:{Q}:jobs:<priority>.",
        "properties": {
            "job_id": {"type": "string", "pattern": p.JOB_ID_PATTERN.pattern,
                       "description": "yours to choose; an id that exists is not run again"},
            "job": {"type": "string", "contentMediaType": "application/json",
                    "contentSchema": {"$ref": "#/$defs/JobSpec"}, "description": "the JSON of a JobSpec"}}}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "redline wire schema", "description": DESCRIPTION, "$defs": dict(sorted(defs.items()))}


def render() -> str:
    return json.dumps(wire_schema(), indent=2) + "\n"


def register(subparsers) -> None:
    parser = subparsers.add_parser("schema", help="print (or write) the JSON Schema of jobs and results")
    parser.add_argument("-o", "--output", default=None, help="write it here (docs/wire-schema.json in the repository)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.output:
        with open(args.output, "w") as f:
            f.write(render())
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m producer.schema", description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default=None)
    sys.exit(main(parser.parse_args()))
