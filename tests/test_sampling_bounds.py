"""Every sampling field is bounded: at its bounds the engine's float32 sampling still gives text and finite
logprobs (tiny model, CPU); past them SamplingParams and Client.submit's validation (the wire schema) refuse
the value in one line that states the bounds. Stop strings and structured-output constraints have size caps,
checked before anything is compiled."""
from __future__ import annotations

import json
import math
import time

import pytest
from queue_helpers import tiny_engine

from engine import SamplingParams
from engine.sampling import params as sp
from producer.client import build_job

PROMPT = [5, 6, 7, 7, 7, 8]  # repeated tokens, so the penalties change logits
ALL_BIASED = {t: -sp.MAX_BIAS for t in range(sp.MAX_LOGIT_BIAS)}


@pytest.fixture(scope="module")
def llm():
    return tiny_engine(max_model_len=128)


@pytest.mark.parametrize("bounds", [
    dict(temperature=sp.MIN_TEMPERATURE),
    dict(temperature=sp.MIN_TEMPERATURE, top_k=5, top_p=0.9),  # the filtering path divides too
    dict(temperature=sp.MAX_TEMPERATURE, logit_bias=ALL_BIASED),
    dict(temperature=sp.MAX_TEMPERATURE, top_k=3),
    dict(top_p=sp.MIN_TOP_P), dict(min_p=1.0), dict(min_p=0.0, top_p=1.0),
    dict(repetition_penalty=sp.MIN_REPETITION_PENALTY), dict(repetition_penalty=sp.MAX_REPETITION_PENALTY),
    dict(repetition_penalty=sp.MIN_REPETITION_PENALTY, logit_bias={40: sp.MAX_BIAS}),
    dict(repetition_penalty=sp.MAX_REPETITION_PENALTY, presence_penalty=sp.MAX_PENALTY,
         frequency_penalty=-sp.MAX_PENALTY, logit_bias=ALL_BIASED),
], ids=lambda d: ",".join(f"{k}={'300 biases' if k == 'logit_bias' and len(v) > 1 else v}" for k, v in d.items()))
def test_at_the_bounds_completions_have_text_and_finite_logprobs(llm, bounds):
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, seed=3, **bounds)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.token_ids) == 8 and out.text
    assert math.isfinite(out.cumulative_logprob)
    assert all(math.isfinite(lp["logprob"]) and all(map(math.isfinite, lp["top"].values())) for lp in out.logprobs)


@pytest.mark.parametrize("field, value, allowed", [
    ("repetition_penalty", 1e-300, "[0.01, 100]"), ("repetition_penalty", 0.0099, "[0.01, 100]"),
    ("repetition_penalty", 100.5, "[0.01, 100]"),
    ("temperature", 1e-300, "0 (greedy) or a number in [0.01, 100]"), ("temperature", 0.005, "[0.01, 100]"),
    ("temperature", 1e39, "[0.01, 100]"), ("temperature", 101, "[0.01, 100]"),
    ("top_p", 1e-300, "[1e-06, 1]"), ("top_p", 9e-7, "[1e-06, 1]"),
])
def test_past_the_bounds_a_value_is_refused_in_one_line_stating_them(field, value, allowed):
    with pytest.raises(ValueError, match=field) as engine_error:
        SamplingParams(**{field: value})
    assert allowed in str(engine_error.value)
    with pytest.raises(ValueError, match=field) as submit_error:
        build_job("hi", sampling={field: value})
    for message in (str(engine_error.value), str(submit_error.value)):
        assert "\n" not in message and len(message) < 400


# ---- stop strings and stop token ids ----------------------------------------------------------------------

def test_the_most_and_longest_stop_strings_run(llm):
    stop = [f"{i:04d}" + "\x07" * (sp.MAX_STOP_CHARS - 4) for i in range(sp.MAX_STOP)]  # never generated
    params = SamplingParams(max_tokens=8, ignore_eos=True, stop=stop,
                            stop_token_ids=list(range(10_000, 10_000 + sp.MAX_STOP_TOKEN_IDS)))
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    build_job("hi", sampling={"stop": stop})


@pytest.mark.parametrize("field, value", [
    ("stop", ["a"] * (sp.MAX_STOP + 1)),
    ("stop", ["x" * (sp.MAX_STOP_CHARS + 1)]),
    ("stop", "x" * (sp.MAX_STOP_CHARS + 1)),
    ("stop", [f"s{i}" for i in range(50_000)]),
    ("stop_token_ids", list(range(sp.MAX_STOP_TOKEN_IDS + 1))),
], ids=["too-many", "too-long", "one-too-long", "50k", "too-many-ids"])
def test_too_many_or_too_long_stops_are_refused_in_one_line(field, value):
    with pytest.raises(ValueError, match=f"{field} must be .*at most") as engine_error:
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"{field} must be .*at most") as submit_error:
        build_job("hi", sampling={field: value})
    for message in (str(engine_error.value), str(submit_error.value)):
        assert "\n" not in message and len(message) < 400


# ---- structured-output constraints ------------------------------------------------------------------------

def _schema_of_length(length: int) -> str:
    """A JSON schema's text of exactly `length` characters."""
    head, tail = '{"type": "string", "description": "', '"}'
    return head + "d" * (length - len(head) - len(tail)) + tail


def _nested(levels: int) -> dict:
    """A schema whose dicts and lists nest exactly `levels` deep (levels odd): objects in objects."""
    schema = {"type": "string"}
    for _ in range((levels - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _choices(count: int, chars: int) -> list[str]:
    """`count` distinct choices of `chars` characters in all."""
    size = chars // count
    choices = [f"{i:03d}".ljust(size, "c") for i in range(count)]
    choices[-1] += "c" * (chars - size * count)
    return choices


ACCEPTED = [
    ("choice", [f"{i:05d}" for i in range(sp.MAX_CHOICES)]),
    ("choice", _choices(64, sp.MAX_CHOICE_CHARS)),
    ("json_schema", _schema_of_length(sp.MAX_SCHEMA_CHARS)),
    ("json_schema", json.loads(_schema_of_length(sp.MAX_SCHEMA_CHARS))),
    ("json_schema", _nested(sp.MAX_SCHEMA_DEPTH - 1)),
    ("regex", "a" * sp.MAX_REGEX_CHARS),
]
REFUSED = [
    ("choice", [f"{i:05d}" for i in range(sp.MAX_CHOICES + 1)], "4,097 choices"),
    ("choice", [f"{i:06d}" for i in range(130_000)], "130,000 choices"),
    ("choice", _choices(64, sp.MAX_CHOICE_CHARS + 1), "262,145 characters in all"),
    ("json_schema", _schema_of_length(sp.MAX_SCHEMA_CHARS + 1), "65,537 characters"),
    ("json_schema", json.loads(_schema_of_length(sp.MAX_SCHEMA_CHARS + 1)), "65,537 characters"),
    ("json_schema", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(12_000)}},
     "characters as JSON"),
    ("json_schema", _nested(sp.MAX_SCHEMA_DEPTH + 1), "nested deeper than 64 levels"),
    ("json_schema", _nested(2001), "nested deeper than 64 levels"),
    ("json_schema", '{"enum": ' + "[" * 30_000 + "]" * 30_000 + "}", "nested deeper than 64 levels"),
    ("regex", "a" * (sp.MAX_REGEX_CHARS + 1), "16,385 characters"),
]


@pytest.mark.parametrize("field, value", ACCEPTED, ids=["choices", "choice-chars", "schema-text", "schema",
                                                        "schema-depth", "regex"])
def test_constraints_at_their_caps_are_accepted(field, value):
    assert getattr(SamplingParams(**{field: value}), field) is not None
    build_job("hi", sampling={field: value})


@pytest.mark.parametrize("field, value, got", REFUSED, ids=[
    "choices", "130k-choices", "choice-chars", "schema-text", "schema", "12k-properties", "schema-depth",
    "schema-2000-deep", "schema-text-30000-deep", "regex"])
def test_constraints_past_their_caps_are_refused_in_one_line_before_compiling(field, value, got):
    start = time.monotonic()
    for check in (lambda: SamplingParams(**{field: value}), lambda: build_job("hi", sampling={field: value})):
        with pytest.raises(ValueError, match=f"{field} must be .*at most") as error:
            check()
        message = str(error.value)
        assert got in message and "\n" not in message and len(message) < 400
    assert time.monotonic() - start < 20  # refused by size, never compiled (130k choices took minutes)


def test_a_job_at_the_choice_cap_runs_on_the_engine(llm):
    choices = [f"{i:05d}" for i in range(sp.MAX_CHOICES)]
    out = llm.generate(["Pick"], SamplingParams(choice=choices, max_tokens=16, temperature=0), use_tqdm=False)[0]
    assert out.text in choices
