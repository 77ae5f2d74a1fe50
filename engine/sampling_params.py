"""Per-request generation settings: each field's default and bounds, defined once.

`SamplingParams` below is the one definition. Its fields carry their bounds as metadata; the engine checks
them when a SamplingParams is built, and the wire schema (`producer.protocol.Sampling`) is generated from
the same fields and runs the same checks, so a job the client accepts is a job the engine accepts.
This module imports nothing heavy: producers import it without torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable

MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what a value must fit to reach a device tensor or a generator


def _spec(default, kind: str, allowed: str, ok: Callable[[Any], bool] = lambda v: True, **bounds):
    """A field with its kind ("float", "int", "bool", "strings", "token_ids"), the sentence an error gives,
    the check, and the numeric bounds the wire's JSON schema states."""
    return field(default=default, metadata={"kind": kind, "allowed": allowed, "ok": ok, "bounds": bounds})


def _int64(v: int) -> bool:
    return INT64_MIN <= v <= INT64_MAX


@dataclass
class SamplingParams:
    """How to sample one request. temperature=0 means greedy."""

    temperature: float = _spec(1.0, "float", "a finite number >= 0 (0 means greedy)", lambda v: v >= 0, ge=0)
    top_p: float = _spec(1.0, "float", "a number in (0, 1]", lambda v: 0 < v <= 1, gt=0, le=1)
    top_k: int = _spec(-1, "int", "-1 (off) or an integer in [1, 2**63-1]",
                       lambda v: v == -1 or 1 <= v <= INT64_MAX, ge=-1, le=INT64_MAX)
    min_p: float = _spec(0.0, "float", "a number in [0, 1]", lambda v: 0 <= v <= 1, ge=0, le=1)
    max_tokens: int = _spec(64, "int", "an integer in [1, 2**63-1]", lambda v: 1 <= v <= INT64_MAX,
                            ge=1, le=INT64_MAX)
    ignore_eos: bool = _spec(False, "bool", "true or false")
    stop: list[str] | str | None = _spec(None, "strings", "a string or a list of non-empty strings",
                                         lambda v: len(v) > 0)
    stop_token_ids: list[int] | None = _spec(None, "token_ids", "a list of token ids in [0, 2**63-1]",
                                             lambda v: 0 <= v <= INT64_MAX)
    seed: int | None = _spec(None, "int", "an integer in [-2**63, 2**63-1], or null", _int64,
                             ge=INT64_MIN, le=INT64_MAX)
    logprobs: int | None = _spec(None, "int", f"null or an integer in [0, {MAX_LOGPROBS}]",
                                 lambda v: 0 <= v <= MAX_LOGPROBS, ge=0, le=MAX_LOGPROBS)

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, check_field(f.name, getattr(self, f.name)))
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


FIELDS = {f.name: f for f in fields(SamplingParams)}


def check_field(name: str, value):
    """`value` as field `name` holds it (a lone stop string becomes a list); ValueError naming the field,
    what it allows and (briefly) what it got."""
    f = FIELDS[name]
    meta = f.metadata
    if value is None and f.default is None:
        return None
    kind, ok, given = meta["kind"], meta["ok"], value
    if kind == "strings" and isinstance(value, str):
        value = [value]
    if kind in ("strings", "token_ids"):
        item_type = str if kind == "strings" else int
        good = isinstance(value, list) and all(_is(item_type, v) and ok(v) for v in value)
    else:
        if kind == "float" and _is(int, value):
            value = float(value) if abs(value) <= 2**1023 else math.inf  # an int too large for a float is not finite
        good = _is({"float": float, "int": int, "bool": bool}[kind], value) and (kind == "bool" or ok(value))
    if not good:
        raise ValueError(f"{name} must be {meta['allowed']}, got {_brief(given)}")
    return value


def _is(kind: type, value) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def _brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
