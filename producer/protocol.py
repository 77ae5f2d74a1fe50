"""The wire contract between producers and workers, defined once.

Everything that crosses Redis is JSON validated by the pydantic models here, and every Redis key is
built by `Keys`. All keys of one queue share the hash tag `{queue}` so a queue lives in one Redis
Cluster slot and the Lua scripts (`producer.scripts`, `worker.scripts`) may touch any of them atomically.

A job is one stream entry with two fields: `job_id` (a string) and `job` (the JSON of `JobSpec`).
"""
from __future__ import annotations

import re
from typing import Annotated, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from engine.inputs import images
from engine.sampling import params as sampling_params

GROUP = "workers"  # the consumer group every worker reads through
PRIORITIES = (2, 1, 0)  # priority levels, read in this order: higher first; 0 is the default
MAX_JOB_BYTES = 4 * 1024 * 1024  # default limit on one job's JSON; workers may lower or raise it
RESULT_TTL_S = 24 * 3600  # a final job's hash and done list expire this long after it ends
# A worker's readers check a job's constraint by its shape and size caps only: its compile check (up to
# engine.sampling.grammar.COMPILE_BUDGET_S) runs on the worker's preparation threads, where it holds no other job back.
DEFER_CONSTRAINT_CHECK = "defer_constraint_check"
AT_WORKER = {DEFER_CONSTRAINT_CHECK: True}  # JobSpec.model_validate_json(raw, context=AT_WORKER)
TOKENS_TTL_S = 3600  # its token stream sooner (at most this); stream() then replays the result instead
RESULTS_FEED_MAXLEN = 100_000  # the results feed keeps about this many recent entries
MAX_ERROR_PROBLEMS = 5  # a validation error names at most this many problems, then how many more
MAX_ERROR_CHARS = 1000  # and is cut to this length: one bad entry never makes a large result
JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")
# an embedding job's bounds: inputs (OpenAI's limit per request), characters of a text, ids of a token list
MAX_EMBED_INPUTS = 2048
MAX_EMBED_TEXT_CHARS = 65_536
MAX_EMBED_TOKENS = 65_536

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
        # the HTTP gateway's (producer.gateway): its files and batches, kept in the queue's slot
        self.files = f"{self.prefix}:files"  # sorted set: file ids by creation time (ms)
        self.batches = f"{self.prefix}:batches"  # sorted set: batch ids by creation time (ms)
        self.open_batches = f"{self.prefix}:batches:open"  # set: batches not final yet, which gateways advance

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

    def file(self, file_id: str) -> str:
        """Hash of a gateway file: `meta` (the OpenAI file object, JSON) and `content` (its bytes)."""
        return f"{self.prefix}:file:{file_id}"

    def batch(self, batch_id: str) -> str:
        """Hash of a gateway batch: its request, its lines' summaries, status and progress."""
        return f"{self.prefix}:batch:{batch_id}"


def new_job_id() -> str:
    import uuid

    return uuid.uuid4().hex


def check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not JOB_ID_PATTERN.match(job_id):
        shown = job_id[:80] + "..." if isinstance(job_id, str) and len(job_id) > 80 else job_id
        raise ValueError(f"job_id {shown!r} is invalid: use 1-200 characters from A-Z a-z 0-9 . _ : @ / + = -")
    return job_id


class _Strict(BaseModel):
    # non-finite floats are refused: JSON has no inf/nan (pydantic would send them as null)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _SamplingChecks(_Strict):
    """Runs the engine's own check of every sampling field, so the wire and the engine agree exactly."""

    @field_validator("*")
    @classmethod
    def _as_the_engine_checks(cls, value, info):
        if value is None:
            return value
        return sampling_params.check_field(info.field_name, value,
                                           not (info.context or {}).get(DEFER_CONSTRAINT_CHECK))

    @model_validator(mode="before")
    @classmethod
    def _stop_as_list(cls, data):
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data

    @model_validator(mode="after")
    def _fields_together(self):
        sampling_params.check_together(self)
        return self

    def model_dump(self, **kwargs) -> dict:
        """As pydantic's, except that a null which means something (max_tokens: until max_model_len) stays
        under exclude_none, so the engine gets it instead of the default."""
        data = super().model_dump(**kwargs)
        if kwargs.get("exclude_none"):
            for name, f in sampling_params.FIELDS.items():
                if f.metadata["nullable"] and getattr(self, name) is None and name not in data:
                    if name not in (kwargs.get("exclude") or ()):
                        data[name] = None
        return data


def _wire_fields() -> dict:
    """Each field of engine.SamplingParams as a pydantic field: its type, default, bounds and description."""
    hints = get_type_hints(sampling_params.SamplingParams)
    out = {}
    for name, f in sampling_params.FIELDS.items():
        annotation = hints[name]
        if name == "stop":  # a lone string is made a list before validation
            annotation = list[str] | None
        elif f.metadata["kind"] == "token_biases":  # JSON's object keys are strings: "50256" is token 50256
            annotation = dict[int | str, float] | None
        out[name] = (annotation, Field(f.default, description=f.metadata["allowed"], **f.metadata["bounds"]))
    return out


Sampling = create_model("Sampling", __base__=_SamplingChecks, __module__=__name__, **_wire_fields())
Sampling.__doc__ = "Sampling parameters: the fields, defaults and bounds of `engine.SamplingParams`."


class ChatMessage(BaseModel):
    """A chat message; its content is text or a list of OpenAI-style content parts: {"type": "text", "text":
    ...} and, for a vision-language model, {"type": "image_url", "image_url": {"url": "data:image/...;base64,
    ..."}} (data URLs only: a worker fetches nothing)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict]

    @field_validator("content")
    @classmethod
    def _parts(cls, value):
        images.image_parts(value)  # the parts' form; their count and sizes are checked per job
        return value


MAX_LORA_NAME_CHARS = 64
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"  # what `--lora NAME=PATH` and a job's `lora` may be


class JobSpec(_Strict):
    """What a producer asks for: exactly one of prompt, messages or prompt_token_ids; or embed, an embedding
    job (its sampling unset)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [  # the one-input rule, for JSON Schema readers
        {"required": [name], "properties": {name: {"type": kind}}}
        for name, kind in (("prompt", "string"), ("messages", "array"), ("prompt_token_ids", "array"),
                           ("embed", "array"))]})
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=0, le=sampling_params.INT64_MAX)]] | None = None
    # an embedding job, for a worker serving an embedding model: its inputs (each a text or token ids), one
    # vector each in the result's `embeddings`; dimensions keeps each vector's first values (renormalised)
    embed: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_EMBED_TEXT_CHARS)]],
                     Field(min_length=1, max_length=MAX_EMBED_INPUTS)] | Annotated[
        list[Annotated[list[Annotated[int, Field(ge=0, le=sampling_params.INT64_MAX)]],
                       Field(min_length=1, max_length=MAX_EMBED_TOKENS)]],
        Field(min_length=1, max_length=MAX_EMBED_INPUTS)] | None = None
    dimensions: int | None = Field(None, ge=1, le=MAX_EMBED_TOKENS)
    sampling: Sampling = Field(default_factory=Sampling)
    # a LoRA adapter the worker was started with (`redline worker --lora NAME=PATH`), by name: never a path, so
    # a job cannot make the worker read its disk; unset: the base model
    lora: str | None = Field(None, min_length=1, max_length=MAX_LORA_NAME_CHARS, pattern=LORA_NAME_PATTERN)
    priority: int = 0
    deadline_s: float | None = Field(None, gt=0)  # seconds after enqueue; later → expired, never run
    stream: bool = True  # write token deltas as they are generated (the final text is always written)

    @field_validator("embed", mode="before")
    @classmethod
    def _embed_inputs(cls, value):
        """A mistake in the inputs said once, in words: left to the union of texts and token-id lists, each is
        worded once per kind of input."""
        error = embed_inputs_error(value)
        if error:
            raise ValueError(error)
        return value

    @model_validator(mode="after")
    def _one_input(self) -> "JobSpec":
        given = [n for n in ("prompt", "messages", "prompt_token_ids", "embed") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, messages, prompt_token_ids, embed (got {given or 'none'})")
        if self.embed is None and self.dimensions is not None:
            raise ValueError("dimensions goes with embed")
        if self.embed is not None and "sampling" in self.model_fields_set:
            raise ValueError("an embedding job takes no sampling")
        if self.embed is not None and self.lora is not None:
            raise ValueError("an embedding job takes no lora")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        if self.messages is not None:  # the engine's default limits: images per job, bytes per image
            images.check_message_images([m.model_dump() for m in self.messages])
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority {self.priority} is not one of {sorted(PRIORITIES)}")
        return self


def embed_inputs_error(value) -> str:
    """What is wrong with an embedding job's list of inputs, in words, or "" (also for what is not a list, which
    JobSpec refuses by its type)."""
    if not isinstance(value, list):
        return ""
    if not value:
        return "needs at least one input (a text or a token-id list)"
    if len(value) > MAX_EMBED_INPUTS:
        return f"holds {len(value):,} inputs; at most {MAX_EMBED_INPUTS:,}"
    texts, ids = all(isinstance(v, str) for v in value), all(isinstance(v, list) for v in value)
    if not (texts or ids):
        return "takes texts or token-id lists, one kind a job"
    limit, unit = (MAX_EMBED_TEXT_CHARS, "characters") if texts else (MAX_EMBED_TOKENS, "token ids")
    for i, v in enumerate(value):
        if not v:
            return f"input {i} is empty"
        if len(v) > limit:
            return f"input {i} holds {len(v):,} {unit}; at most {limit:,}"
    return ""


def embed_inputs(value):
    """OpenAI's embeddings `input` (a text, a list of texts, token ids, or a list of token-id lists) as the list
    JobSpec.embed takes; anything else is left for JobSpec to refuse."""
    if isinstance(value, str) or is_token_ids(value):
        return [value]
    return value


def is_token_ids(value) -> bool:
    """Whether `value` is a non-empty list of token ids (ints, not bools), as OpenAI's inputs give one."""
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Timings(BaseModel):
    """Seconds. queue: enqueue → handed to the engine; ttft and e2e are measured inside the engine."""

    queue_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None


class Completion(BaseModel):
    """One of a job's completions (sampling n > 1 or best_of)."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list | None = None
    cumulative_logprob: float | None = None


class JobResult(BaseModel):
    """A job's outcome. text, token_ids, finish_reason, logprobs and cumulative_logprob are the first
    completion's; `outputs` holds every completion when the job asked for more than one (n > 1)."""

    job_id: str
    status: FinalStatus
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" when the engine ran the job
    error: str | None = None
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    logprobs: list | None = None  # per token: token_id, token (its text), logprob, top ({id: logprob}), top_logprobs
    cumulative_logprob: float | None = None  # the sum of the completion's token logprobs
    outputs: list[Completion] | None = None
    # with sampling prompt_logprobs=N, one entry per prompt token: token_id, token (its text), logprob and rank
    # (null for the first token, which nothing scores), top_logprobs ([{token_id, token, logprob, rank}], the
    # top N, best first; [] for the first token)
    prompt_logprobs: list | None = None
    embeddings: list[list[float]] | None = None  # an embedding job's vectors, one per input, in order
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
    """One entry of a job's token stream: new tokens and text of completion `completion` (0 to n - 1, as
    the result's `outputs`); `index` is the position of its first token in that completion. A job with
    n > 1 streams its completions' deltas interleaved: concatenate each completion's own. With best_of,
    each chosen completion comes whole once the job ends.

    A delta with `restart` true means a new attempt began after a worker died: discard what you have.
    The last delta of a stream has `finished` true and carries the final status.
    """

    index: int = 0
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    completion: int = 0
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
    """The problems on one line, e.g. `sampling.max_tokens: Input should be greater than or equal to 1`;
    the first MAX_ERROR_PROBLEMS of them, then how many more."""
    problems = err.errors(include_url=False)
    parts = []
    for e in problems[:MAX_ERROR_PROBLEMS]:
        loc = [str(part) for part in e["loc"]]
        msg = e["msg"].removeprefix("Value error, ")
        if loc and msg.startswith(f"{loc[-1]} must "):  # the engine's check names the field itself
            parts.append(".".join(loc[:-1] + [msg]))
        else:
            parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    if len(problems) > MAX_ERROR_PROBLEMS:
        parts.append(f"and {len(problems) - MAX_ERROR_PROBLEMS} more")
    return clean_error("; ".join(parts))


def clean_error(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """An error fit to store and print: control characters escaped, one line, at most `limit` characters."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message))
    return text if len(text) <= limit else f"{text[:limit - 30]}... ({len(text) - limit + 30:,} more characters)"


def final_args(job_id: str, status: str, error: str) -> tuple[str, str]:
    """The result and end-of-stream JSON for a job that ends without running."""
    error = clean_error(error) if error else error
    result = JobResult(job_id=job_id, status=status, error=error).model_dump_json()
    end = TokenDelta(finished=True, status=status, error=error).model_dump_json()
    return result, end


def decode(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
