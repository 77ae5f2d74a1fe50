"""Per-request generation settings, validated when built."""
from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to sample one request. temperature=0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, "a number >= 0 (0 means greedy)", lambda v: v >= 0)
        _check_number("top_p", self.top_p, "a number in (0, 1]", lambda v: 0 < v <= 1)
        _check_number("min_p", self.min_p, "a number in [0, 1]", lambda v: 0 <= v <= 1)
        _check_int("top_k", self.top_k, "-1 (off) or an integer >= 1", lambda v: v == -1 or v >= 1)
        _check_int("max_tokens", self.max_tokens, "an integer >= 1", lambda v: v >= 1)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, "an integer or None", lambda v: True)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]",
                       lambda v: 0 <= v <= MAX_LOGPROBS)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, "a list of token ids >= 0", lambda v: v >= 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_number(name: str, value, allowed: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_int(name: str, value, allowed: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
