"""The messages the worker's threads pass each other, one small class each: a thread dispatches on the type.

To the engine thread (its inbox): `RunJob`, `AbortJob`, `Wake`.
To the writer thread (its outbox): `StepOutputs`, `JobStarted`, `JobEnded`, `JobHandedBack` (then
`results.STOP` once the engine is done).
"""
from __future__ import annotations

from dataclasses import dataclass

from .consumer import Job


@dataclass(slots=True)
class RunJob:
    """Start this job in the engine (its room is taken, its preparation done)."""

    job: Job


@dataclass(slots=True)
class AbortJob:
    """Stop this job in the engine (cancelled, taken over by another worker, or handed back)."""

    job_id: str


@dataclass(slots=True)
class Wake:
    """Nothing to do: the engine thread looks at the drain again."""


@dataclass(slots=True)
class StepOutputs:
    """One engine step's outputs: the finished ones, and the unfinished ones of jobs that stream tokens."""

    outputs: list


@dataclass(slots=True)
class JobStarted:
    """The engine took a job of another source, which records that (Celery's STARTED)."""

    job: Job


@dataclass(slots=True)
class JobEnded:
    """A job that ends without an engine output: its status (failed, cancelled) and why."""

    job: Job
    status: str
    error: str


@dataclass(slots=True)
class JobHandedBack:
    """The worker stops before the job runs: it goes back to its queue for another worker."""

    job: Job
