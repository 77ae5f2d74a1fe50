"""The wire contract between producers and workers, defined once.

Everything that crosses Redis is JSON validated by the pydantic models here, and every Redis key is
built by `Keys`. All keys of one queue share the hash tag `{queue}` so a queue lives in one Redis
Cluster slot and the Lua scripts in `producer.scripts` may touch any of them atomically.

A job is one stream entry with two fields: `job_id` (a string) and `job` (the JSON of `JobSpec`).
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

GROUP = "workers"  # the consumer group every worker reads through
PRIORITIES = (2, 1, 0)  # priority levels, read in this order: higher first; 0 is the default
MAX_JOB_BYTES = 4 * 1024 * 1024  # default limit on one job's JSON; workers may lower or raise it
RESULT_TTL_S = 24 * 3600  # a final job's hash and done list expire this long after it ends
TOKENS_TTL_S = 3600  # its token stream sooner (at most this); stream() then replays the result instead
RESULTS_FEED_MAXLEN = 100_000  # the results feed keeps about this many recent entries
JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")

QUEUED, RUNNING = "queued", "running"
SUCCEEDED, FAILED, CANCELLED, EXPIRED = "succeeded", "failed", "cancelled", "expired"
FINAL_STATUSES = (SUCCEEDED, FAILED, CANCELLED, EXPIRED)
Status = Literal["queued", "running", "succeeded", "failed", "cancelled", "expired"]
FinalStatus = Literal["succeeded", "failed", "cancelled", "expired"]


class Keys:
    """Every Redis key of one queue. No other module spells a key."""

    def __init__(self, queue: str = "default") -> None:
        if not queue or any(c in queue for c in "{}: \t\n"):
            raise ValueError(f"queue name {queue!r} must be non-empty without braces, colons or spaces")
        self.queue = queue
        self.prefix = f"redline:{{{queue}}}"
        self.cancels = f"{self.prefix}:cancels"  # stream of job ids to cancel, read by every worker
        self.dead = f"{self.prefix}:dead"  # dead letters: the original entry plus the error
        self.results = f"{self.prefix}:results"  # feed of finished jobs: one entry per written result

    def jobs(self, priority: int = 0) -> str:
        """The job stream of one priority level (consumer group `GROUP`)."""
        return f"{self.prefix}:jobs:{priority}"

    def all_jobs(self) -> list[str]:
        """Job streams in reading order, highest priority first."""
        return [self.jobs(p) for p in PRIORITIES]

    def job(self, job_id: str) -> str:
        """Hash: status, attempts, entry, result, error, timestamps; expires once final."""
        return f"{self.prefix}:job:{job_id}"

    def tokens(self, job_id: str) -> str:
        """Stream of `TokenDelta` entries, ending with one whose `finished` is true."""
        return f"{self.prefix}:tokens:{job_id}"

    def done(self, job_id: str) -> str:
        """List that gets one element when the result is written: what `result()` blocks on."""
        return f"{self.prefix}:done:{job_id}"


def new_job_id() -> str:
    import uuid

    return uuid.uuid4().hex


def check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not JOB_ID_PATTERN.match(job_id):
        shown = job_id[:80] + "..." if isinstance(job_id, str) and len(job_id) > 80 else job_id
        raise ValueError(f"job_id {shown!r} is invalid: use 1-200 characters from A-Z a-z 0-9 . _ : @ / + = -")
    return job_id


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Sampling(_Strict):
    """Sampling parameters; the same names and defaults as `engine.SamplingParams`."""

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(64, ge=1)
    ignore_eos: bool = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _stop_as_list(cls, data):
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str


class JobSpec(_Strict):
    """What a producer asks for: exactly one of prompt, messages or prompt_token_ids."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    priority: int = 0
    deadline_s: float | None = Field(None, gt=0)  # seconds after enqueue; later → expired, never run
    stream: bool = True  # write token deltas as they are generated (the final text is always written)

    @model_validator(mode="after")
    def _one_input(self) -> "JobSpec":
        given = [n for n in ("prompt", "messages", "prompt_token_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, messages, prompt_token_ids (got {given or 'none'})")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority {self.priority} is not one of {sorted(PRIORITIES)}")
        return self


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Timings(BaseModel):
    """Seconds. queue: enqueue → handed to the engine; ttft and e2e are measured inside the engine."""

    queue_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None


class JobResult(BaseModel):
    job_id: str
    status: FinalStatus
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" when the engine ran the job
    error: str | None = None
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    logprobs: list | None = None
    attempts: int = 0
    worker: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == SUCCEEDED


class JobStatus(BaseModel):
    job_id: str
    status: Status
    attempts: int = 0
    worker: str | None = None
    error: str | None = None


class TokenDelta(BaseModel):
    """One entry of a job's token stream. `index` is the position of the first token in this delta.

    A delta with `restart` true means a new attempt began after a worker died: discard what you have.
    The last delta of a stream has `finished` true and carries the final status.
    """

    index: int = 0
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    attempt: int = 1
    restart: bool = False
    finished: bool = False
    status: FinalStatus | None = None
    finish_reason: str | None = None
    error: str | None = None
    id: str | None = Field(None, exclude=True)  # the stream entry id: pass it back to resume after it


class DeadLetter(BaseModel):
    id: str  # entry id in the dead-letter stream
    job_id: str
    stream: str
    deliveries: int
    error: str
    job: str | None = None  # the original `job` field, verbatim


def describe_validation_error(err: ValidationError) -> str:
    """One line per problem, e.g. `sampling.max_tokens: Input should be greater than or equal to 1`."""
    parts = []
    for e in err.errors(include_url=False):
        where = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def decode(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
