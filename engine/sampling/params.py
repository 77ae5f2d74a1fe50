"""Per-request generation settings: each field's default and bounds, defined once.

`SamplingParams` below is the one definition. Its fields carry their bounds as metadata; the engine checks
them when a SamplingParams is built, and the wire schema (`producer.protocol.Sampling`) is generated from
the same fields and runs the same checks, so a job the client accepts is a job the engine accepts.
This module imports nothing heavy: producers import it without torch. A structured-output constraint
(json_schema, regex, choice) is checked by compiling it without a tokenizer (engine/sampling/grammar.py, llguidance).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable

MAX_LOGPROBS = 20
MAX_N = 128            # completions (n, best_of) or beams of one request
MAX_LOGIT_BIAS = 300   # biased tokens of one request (OpenAI's limit)
MAX_BIAS = 100.0       # |bias| of one token (OpenAI's)
MAX_PENALTY = 2.0      # |presence_penalty|, |frequency_penalty| (OpenAI's)
# logits are divided by t: below 0.01 (vLLM's floor too) 1/t pushes float32/bf16 logits towards inf, and a tiny
# t rounds to 0 in float32; above 100 the distribution is flat already, and past float32's range -inf / t is NaN
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
MIN_TOP_P = 1e-6  # smaller keeps the top token alone anyway; below float32's range it rounds to 0 and masks every token
# a seen token's logit is divided or multiplied by it: 100x either way outweighs any logit gap already, and
# 1e-300 rounds to 0 in float32 (NaN logprobs, empty text)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_STOP = 64          # stop strings of one request: each is looked for in the completion's text at every token
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids of one request: each generated token is looked up in them
# structured output, checked before compiling: 130k choices made llguidance panic (a grammar symbol each, under
# 65k) and 4,096 check and compile in ~0.05 s; a schema's time grows with its size (12k properties: seconds; a
# 64 KiB one of ~2,000: ~0.5 s) and a deep one is refused by llguidance anyway (about 130 levels)
MAX_CHOICES = 4096
MAX_CHOICE_CHARS = 256 * 1024  # all the choices' characters together
MAX_SCHEMA_CHARS = 64 * 1024   # a JSON schema's JSON text
MAX_SCHEMA_DEPTH = 64          # objects and arrays nested in a JSON schema
MAX_REGEX_CHARS = 16 * 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what a value must fit to reach a device tensor or a generator
_TOKEN_ID_TEXT = re.compile(r"[0-9]{1,19}")  # a token id as a JSON object key spells it
CONSTRAINTS = ("json_schema", "regex", "choice")  # structured output: at most one of them


def _spec(default, kind: str, allowed: str, ok: Callable[[Any], bool] = lambda v: True, nullable: bool = False,
          max_items: int | None = None, schema: dict | None = None, **bounds):
    """A field with its kind ("float", "int", "bool", "strings", "token_ids", "token_biases", or a constraint:
    "json_schema", "regex", "choices"), the sentence an error gives, the check (of each item, for a list),
    the most items a list may hold, and the bounds the wire's JSON schema states (numeric ones, and `schema`:
    JSON Schema keywords of their own). nullable: None is a value of its own although the default is not
    (max_tokens=None: until max_model_len)."""
    extra = {**({"maxItems": max_items} if max_items else {}), **(schema or {})}
    if extra:
        bounds["json_schema_extra"] = extra
    return field(default=default, metadata={"kind": kind, "allowed": allowed, "ok": ok, "bounds": bounds,
                                            "nullable": nullable, "max_items": max_items})


def _int64(v: int) -> bool:
    return INT64_MIN <= v <= INT64_MAX


@dataclass
class SamplingParams:
    """How to sample one request. temperature=0 means greedy."""

    n: int = _spec(1, "int", f"an integer in [1, {MAX_N}]", lambda v: 1 <= v <= MAX_N, ge=1, le=MAX_N)
    best_of: int | None = _spec(None, "int", f"null or an integer in [n, {MAX_N}]", lambda v: 1 <= v <= MAX_N,
                                ge=1, le=MAX_N)
    temperature: float = _spec(
        1.0, "float", f"0 (greedy) or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
        lambda v: v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE, ge=0, le=MAX_TEMPERATURE,
        schema={"not": {"exclusiveMinimum": 0, "exclusiveMaximum": MIN_TEMPERATURE}})
    top_p: float = _spec(1.0, "float", f"a number in [{MIN_TOP_P:g}, 1]", lambda v: MIN_TOP_P <= v <= 1,
                         ge=MIN_TOP_P, le=1)
    top_k: int = _spec(-1, "int", "-1 (off) or an integer in [1, 2**63-1]",
                       lambda v: v == -1 or 1 <= v <= INT64_MAX, ge=-1, le=INT64_MAX)
    min_p: float = _spec(0.0, "float", "a number in [0, 1]", lambda v: 0 <= v <= 1, ge=0, le=1)
    max_tokens: int | None = _spec(64, "int", "an integer in [1, 2**63-1], or null (until max_model_len)",
                                   lambda v: 1 <= v <= INT64_MAX, nullable=True, ge=1, le=INT64_MAX)
    min_tokens: int = _spec(0, "int", "an integer in [0, max_tokens]", lambda v: 0 <= v <= INT64_MAX,
                            ge=0, le=INT64_MAX)
    ignore_eos: bool = _spec(False, "bool", "true or false")
    stop: list[str] | str | None = _spec(
        None, "strings", f"a string or a list of at most {MAX_STOP} strings, each of 1 to {MAX_STOP_CHARS} characters",
        lambda v: 0 < len(v) <= MAX_STOP_CHARS, max_items=MAX_STOP,
        schema={"items": {"minLength": 1, "maxLength": MAX_STOP_CHARS}})
    stop_token_ids: list[int] | None = _spec(
        None, "token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} token ids in [0, 2**63-1]",
        lambda v: 0 <= v <= INT64_MAX, max_items=MAX_STOP_TOKEN_IDS)
    seed: int | None = _spec(None, "int", "an integer in [-2**63, 2**63-1], or null", _int64,
                             ge=INT64_MIN, le=INT64_MAX)
    repetition_penalty: float = _spec(
        1.0, "float", f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 is off)",
        lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
        ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    presence_penalty: float = _spec(0.0, "float", f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                                    lambda v: abs(v) <= MAX_PENALTY, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = _spec(0.0, "float", f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                                     lambda v: abs(v) <= MAX_PENALTY, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[int, float] | None = _spec(
        None, "token_biases", f"null or a map of at most {MAX_LOGIT_BIAS} token ids (integers or their decimal "
        f"strings) to biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}]", lambda v: abs(v) <= MAX_BIAS)
    logprobs: int | None = _spec(None, "int", f"null or an integer in [0, {MAX_LOGPROBS}]",
                                 lambda v: 0 <= v <= MAX_LOGPROBS, ge=0, le=MAX_LOGPROBS)
    json_schema: dict[str, Any] | str | None = _spec(
        None, "json_schema", f"a JSON schema (an object or its JSON text) of at most {MAX_SCHEMA_CHARS:,} characters "
        f"as JSON, nested at most {MAX_SCHEMA_DEPTH} levels", schema={"maxLength": MAX_SCHEMA_CHARS})
    regex: str | None = _spec(None, "regex", f"a regular expression (Rust regex syntax) of at most "
                              f"{MAX_REGEX_CHARS:,} characters", schema={"maxLength": MAX_REGEX_CHARS})
    choice: list[str] | None = _spec(
        None, "choices", f"a non-empty list of at most {MAX_CHOICES:,} non-empty strings, {MAX_CHOICE_CHARS:,} "
        "characters in all", max_items=MAX_CHOICES, schema={"minItems": 1, "items": {"minLength": 1}})
    prompt_logprobs: int | None = _spec(None, "int", f"null or an integer in [0, {MAX_LOGPROBS}]",
                                        lambda v: 0 <= v <= MAX_LOGPROBS, ge=0, le=MAX_LOGPROBS)

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, check_field(f.name, getattr(self, f.name)))
        check_together(self)
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @classmethod
    def from_checked(cls, values: dict) -> "SamplingParams":
        """SamplingParams of values that these same checks have passed already (the worker's parse of the wire's
        `Sampling`, which runs them): built without running them again. Unchecked values must not come here."""
        params = cls.__new__(cls)
        for name, f in FIELDS.items():
            setattr(params, name, values.get(name, f.default))
        params.stop = list(params.stop or [])
        params.stop_token_ids = list(params.stop_token_ids or [])
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_sequences(self) -> int:
        """How many sequences the request runs: best_of, or n."""
        return self.best_of or self.n

    @property
    def constraint(self) -> tuple[str, Any] | None:
        """(field, value) of its structured-output constraint, or None."""
        return constraint(self)

    @property
    def penalises(self) -> bool:
        """Whether it has a repetition, presence or frequency penalty."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether its logits are changed before sampling (penalties, biases, min_tokens)."""
        return self.penalises or bool(self.logit_bias) or self.min_tokens > 0


@dataclass
class BeamSearchParams:
    """Beam search as transformers' generate(num_beams=beam_width, num_return_sequences=beam_width,
    length_penalty=length_penalty, early_stopping=True, do_sample=False) runs it."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        checks = {"beam_width": (int, lambda v: 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]"),
                  "max_tokens": (int, lambda v: 1 <= v <= INT64_MAX, "an integer in [1, 2**63-1]"),
                  "ignore_eos": (bool, lambda v: True, "true or false"),
                  "length_penalty": (float, lambda v: True, "a finite number")}
        for name, (kind, ok, allowed) in checks.items():
            value = getattr(self, name)
            if kind is float and _is(int, value):
                value = float(value)
            if not (_is(kind, value) and ok(value)):
                raise ValueError(f"{name} must be {allowed}, got {_brief(getattr(self, name))}")
            setattr(self, name, value)


FIELDS = {f.name: f for f in fields(SamplingParams)}


def check_field(name: str, value, compile_constraint: bool = True):
    """`value` as field `name` holds it (a lone stop string becomes a list, logit_bias keys become ints);
    ValueError naming the field, what it allows and (briefly) what it got. compile_constraint=False checks a
    constraint's shape and size caps only, leaving its compile check to a thread that may take the time."""
    f = FIELDS[name]
    meta = f.metadata
    if value is None and (f.default is None or meta["nullable"]):
        return None
    kind, ok, given = meta["kind"], meta["ok"], value
    if kind in ("json_schema", "regex", "choices"):
        return _constraint(name, value, meta["allowed"], compile_constraint)
    if kind == "strings" and isinstance(value, str):
        value = [value]
    if kind == "token_biases":
        value = _token_biases(value, ok)
        good = value is not None
    elif kind in ("strings", "token_ids"):
        item_type = str if kind == "strings" else int
        good = (isinstance(value, list) and len(value) <= meta["max_items"]
                and all(_is(item_type, v) and ok(v) for v in value))
    else:
        if kind == "float" and _is(int, value):
            value = float(value) if abs(value) <= 2**1023 else math.inf  # an int too large for a float is not finite
        good = _is({"float": float, "int": int, "bool": bool}[kind], value) and (kind == "bool" or ok(value))
    if not good:
        raise ValueError(f"{name} must be {meta['allowed']}, got {_brief(given)}")
    return value


def check_together(params) -> None:
    """The checks that involve two fields (`params`: a SamplingParams or the wire's Sampling)."""
    if params.best_of is not None and params.best_of < params.n:
        raise ValueError(f"best_of must be null or an integer in [n, {MAX_N}] (n is {params.n}), got {params.best_of}")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise ValueError(f"min_tokens must be an integer in [0, max_tokens] (max_tokens is {params.max_tokens}), "
                         f"got {params.min_tokens}")
    given = [name for name in CONSTRAINTS if getattr(params, name) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, regex, choice (got {', '.join(given)})")
    if given and params.min_tokens:
        raise ValueError(f"min_tokens must be 0 with {given[0]}: the constraint decides where the completion ends, "
                         f"got {params.min_tokens}")


def constraint(params) -> tuple[str, Any] | None:
    """(field, value) of the structured-output constraint of `params` (a SamplingParams or the wire's
    Sampling), or None."""
    return next(((name, getattr(params, name)) for name in CONSTRAINTS if getattr(params, name) is not None), None)


def _constraint(name: str, value, allowed: str, compile_check: bool = True):
    """A constraint as SamplingParams holds it (a schema's JSON text parsed), checked against its size caps and
    then by compiling its grammar without a tokenizer; ValueError naming the field otherwise."""
    if name == "json_schema" and isinstance(value, str):
        value = _schema_of_text(value, allowed)
    good = {"json_schema": lambda v: isinstance(v, dict),
            "regex": lambda v: isinstance(v, str),
            "choice": lambda v: isinstance(v, list) and v and all(isinstance(c, str) and c for c in v)}[name]
    if not good(value):
        raise ValueError(f"{name} must be {allowed}, got {_brief(value)}")
    too_large = _constraint_too_large(name, value)
    if too_large:
        raise ValueError(f"{name} must be {allowed}, got {too_large}")
    if not compile_check:
        return value
    from engine.sampling import grammar  # llguidance: no Python dependencies, no torch

    error = grammar.check(name, value)
    if error:
        raise ValueError(f"{name} must be {allowed}; got one that cannot be enforced: {error}")
    return value


def _schema_of_text(text: str, allowed: str):
    """A JSON schema's JSON text parsed, within its size and depth caps."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"json_schema must be {allowed}, got one of {len(text):,} characters")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"json_schema must be {allowed}, got one nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
    except ValueError as e:
        raise ValueError(f"json_schema must be {allowed}, got {_brief(text)} (not JSON: {e})") from None


def _constraint_too_large(name: str, value) -> str:
    """What exceeds the constraint's caps ("one of 70,000 choices"), or ""."""
    if name == "regex" and len(value) > MAX_REGEX_CHARS:
        return f"one of {len(value):,} characters"
    if name == "choice":
        chars = sum(len(c) for c in value)
        if len(value) > MAX_CHOICES or chars > MAX_CHOICE_CHARS:
            return f"{len(value):,} choices of {chars:,} characters in all"
    if name == "json_schema":
        if nesting_exceeds(value, MAX_SCHEMA_DEPTH, MAX_SCHEMA_CHARS):
            return f"one nested deeper than {MAX_SCHEMA_DEPTH} levels or larger than {MAX_SCHEMA_CHARS:,} characters"
        try:
            size = len(json.dumps(value, ensure_ascii=False))
        except (TypeError, ValueError):
            return f"{_brief(value)} (not JSON)"
        if size > MAX_SCHEMA_CHARS:
            return f"one of {size:,} characters as JSON"
    return ""


def nesting_exceeds(value, max_depth: int, max_containers: float = math.inf) -> bool:
    """Whether `value`'s dicts and lists nest deeper than max_depth (the outermost is depth 1) or number more
    than max_containers, walked a level at a time (no recursion; an object that contains itself is too deep)."""
    level, depth, seen = [value], 0, 0
    while True:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            return False
        depth, seen = depth + 1, seen + len(containers)
        if depth > max_depth or seen > max_containers:
            return True
        level = [item for c in containers for item in (c.values() if isinstance(c, dict) else c)]


def _token_biases(value, ok) -> dict[int, float] | None:
    """{token id: bias} from a dict whose keys are ints or decimal strings (JSON's keys), or None if it is
    not one."""
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        return None
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and _TOKEN_ID_TEXT.fullmatch(key):
            key = int(key)
        if not (_is(int, key) and 0 <= key <= INT64_MAX and _is(float, bias) and ok(bias)) or key in out:
            return None
        out[key] = float(bias)
    return out


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
