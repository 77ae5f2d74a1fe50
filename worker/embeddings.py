"""Embedding jobs in the engine thread: one engine request per input, one output for the job.

A job's inputs become engine requests `<job id>#<i>` ('#' is no job id's character); their outputs are held
here until the last is in, then the job's `JobEmbeddings` goes to the writer in its place, as one finished
engine output would.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class JobEmbeddings:
    """An embedding job's outcome, shaped as the writer reads a finished engine output."""
    request_id: str                           # the job id
    embeddings: list[list[float]] | None      # one per input, in order; None unless every input succeeded
    prompt_token_ids: list[int]               # every input's tokens, one after another (usage, metrics)
    num_cached_tokens: int = 0
    finish_reason: str = "stop"               # "abort" when any input was aborted
    error: str | None = None
    arrival_time: float | None = None
    finished_time: float | None = None
    finished: bool = True
    token_ids: list[int] = field(default_factory=list)  # none generated
    outputs: list = field(default_factory=list)  # no completions
    first_token_time: float | None = None


class EmbeddingJobs:
    """The engine's embedding jobs in flight, by job id."""

    def __init__(self) -> None:
        self.outputs: dict[str, list] = {}  # job id -> its inputs' outputs so far (None until in)
        self.request_job: dict[str, tuple[str, int]] = {}  # engine request id -> (job id, input index)
        self.dropped: set[str] = set()  # inputs of a job that failed to start: their abort outputs are dropped

    def start(self, engine, job_id: str, inputs: list, dimensions: int | None) -> None:
        """Add the job's inputs to the engine; raises ValueError (nothing left in the engine) for a bad one."""
        added = []
        try:
            for i, item in enumerate(inputs):
                added.append(engine.add_embed_request(item, dimensions, request_id=f"{job_id}#{i}"))
        except ValueError as e:
            for rid in added:
                engine.abort(rid)
            self.dropped.update(added)
            raise ValueError(f"input {len(added)}: {e}") if len(inputs) > 1 else e from None
        self.outputs[job_id] = [None] * len(inputs)
        for i, rid in enumerate(added):
            self.request_job[rid] = (job_id, i)

    def abort(self, engine, job_id: str) -> bool:
        """Abort every input of an embedding job still running; False when `job_id` is no embedding job here."""
        outputs = self.outputs.get(job_id)
        if outputs is None:
            return False
        for i, out in enumerate(outputs):
            if out is None:
                engine.abort(f"{job_id}#{i}")
        return True

    def collect(self, outputs: list) -> list:
        """A step's outputs with its embedding inputs' outputs replaced by each job whose inputs are all in."""
        if not self.request_job and not self.dropped:
            return outputs
        kept = []
        for out in outputs:
            place = self.request_job.pop(out.request_id, None)
            if place is None:
                if out.request_id in self.dropped:
                    self.dropped.discard(out.request_id)
                else:
                    kept.append(out)
                continue
            job_id, i = place
            held = self.outputs[job_id]
            held[i] = out
            if all(o is not None for o in held):
                del self.outputs[job_id]
                kept.append(_job_output(job_id, held))
        return kept


def _job_output(job_id: str, outs: list) -> JobEmbeddings:
    error = next((o.error for o in outs if o.error is not None), None)
    aborted = any(o.finish_reason != "stop" for o in outs)
    return JobEmbeddings(
        request_id=job_id, embeddings=None if aborted or error else [o.embedding for o in outs],
        prompt_token_ids=[t for o in outs for t in o.prompt_token_ids],
        num_cached_tokens=sum(o.num_cached_tokens for o in outs), finish_reason="abort" if aborted else "stop",
        error=error, arrival_time=min(o.arrival_time for o in outs),
        finished_time=max(o.finished_time or 0.0 for o in outs))
