"""What the engine hands back: per-request outputs and per-step counts."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                  # every completion token so far
    new_token_ids: list[int]              # completion tokens produced in this step
    finished: bool = False
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    error: str | None = None              # why the request failed on its own ("abort" with the others going on)
    text: str | None = None               # set once finished (None without a tokenizer)
    logprobs: list[dict] | None = None    # per token: {"token_id", "logprob", "top": {id: logprob}}
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __getitem__(self, key: str):  # outputs[i]["text"] works as in nano-vllm
        return getattr(self, key)


@dataclass
class StepStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    step_seconds: float = 0.0
    batch_size: int = 0


@dataclass
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    stats: StepStats = field(default_factory=StepStats)

    @property
    def finished(self) -> list[RequestOutput]:
        return [o for o in self.outputs if o.finished]
