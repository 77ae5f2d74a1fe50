"""The sampling fields are defined once: what the wire schema accepts, engine.SamplingParams accepts, and
the reverse; the engine's own limits are checked where a request enters it, so no value can break a step."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.sampling.params import FIELDS, INT64_MAX, INT64_MIN
from producer import protocol as p
from producer.client import build_job

EDGE_INTS = [0, 1, -1, 20, 21, INT64_MAX, INT64_MAX + 1, INT64_MIN, INT64_MIN - 1, 2**64, 10**30, -(10**30)]
EDGE_FLOATS = [0.0, -0.0, 1e-300, 0.5, 1.0, 1.5, 1e308, math.inf, -math.inf, math.nan]

scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.integers(),
                    st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=20))
values = st.one_of(scalars, st.lists(scalars, max_size=4), st.dictionaries(st.text(max_size=5), scalars, max_size=3))
sampling_dicts = st.dictionaries(st.sampled_from(sorted(FIELDS)), values, max_size=5)


def _engine_accepts(d: dict):
    try:
        return SamplingParams(**d), None
    except ValueError as e:
        return None, str(e)


def _wire_accepts(d: dict):
    try:
        return p.Sampling.model_validate(d), None
    except p.ValidationError as e:
        return None, p.describe_validation_error(e)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampling_dicts)
def test_the_wire_and_the_engine_accept_exactly_the_same_sampling(d):
    engine_params, engine_error = _engine_accepts(d)
    wire, wire_error = _wire_accepts(d)
    assert (engine_params is None) == (wire is None), (d, engine_error, wire_error)
    if wire is not None:
        assert SamplingParams(**wire.model_dump(exclude_none=True)) == engine_params
    else:
        assert "\n" not in wire_error and len(wire_error) <= p.MAX_ERROR_CHARS


@settings(max_examples=300, deadline=None)
@given(sampling_dicts)
def test_a_job_that_survives_json_is_one_the_engine_takes(d):
    """Through build_job (Client.submit's validation) and the JSON the worker reads back."""
    try:
        _, _, spec_json = build_job("hi", sampling=d)
    except ValueError as e:
        message = str(e)
        assert "\n" not in message and len(message) <= p.MAX_ERROR_CHARS + 20
        return
    spec = p.JobSpec.model_validate_json(spec_json)
    SamplingParams(**spec.sampling.model_dump(exclude_none=True))


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**63), ("top_k", 10**30), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 10**30),
    ("temperature", math.inf), ("temperature", math.nan), ("temperature", 10**400), ("top_k", 0),
    ("logprobs", 21), ("stop", [""]), ("stop_token_ids", [-1]), ("max_tokens", 0), ("top_p", 0.0),
    ("repetition_penalty", 1e-300), ("temperature", 1e-300), ("top_p", 1e-300), ("stop", ["s"] * 50_000)])
def test_values_the_engine_cannot_take_are_refused_at_submit_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        build_job("hi", sampling={field: value})


def test_non_finite_numbers_are_refused_at_submit_not_sent_as_null():
    with pytest.raises(ValueError, match="finite"):
        build_job("hi", sampling={"temperature": math.inf})
    with pytest.raises(ValueError, match="finite"):
        build_job("hi", deadline_s=math.inf)


def test_int64_edges_are_accepted_by_both():
    d = {"top_k": INT64_MAX, "seed": INT64_MIN, "max_tokens": INT64_MAX, "stop_token_ids": [0, INT64_MAX]}
    assert SamplingParams(**d).seed == INT64_MIN
    _, _, spec_json = build_job("hi", sampling=d)
    assert json.loads(spec_json)["sampling"]["seed"] == INT64_MIN


def test_validation_errors_name_five_problems_then_how_many_more_on_one_line():
    bad = {"prompt": "x", "sampling": {"stop_token_ids": ["a"] * 500, "top_k": 0, "logprobs": 99, "top_p": 3,
                                       "min_p": -1, "temperature": -2, "max_tokens": 0}}
    with pytest.raises(p.ValidationError) as info:
        p.JobSpec.model_validate(bad)
    message = p.describe_validation_error(info.value)
    assert message.count(";") == 5 and message.endswith("more")
    assert len(message) < 2000


def test_control_characters_of_a_payload_are_escaped_in_errors():
    message = p.clean_error("bad \x00\x1b[31m\nline\u2028" + "x" * 5000)
    assert message.isprintable() and "\\x1b" in message and "\\n" in message
    assert len(message) <= p.MAX_ERROR_CHARS


def test_the_engine_clamps_top_k_to_its_vocabulary_and_seeds_any_int64():
    from queue_helpers import tiny_engine

    llm = tiny_engine()
    outs = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(top_k=INT64_MAX, seed=INT64_MIN, max_tokens=4),
                                              SamplingParams(seed=INT64_MAX, top_p=0.5, max_tokens=4)],
                        use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [4, 4]
    again = llm.generate([[1, 2, 3]], SamplingParams(top_k=INT64_MAX, seed=INT64_MIN, max_tokens=4), use_tqdm=False)
    assert again[0].token_ids == outs[0].token_ids
