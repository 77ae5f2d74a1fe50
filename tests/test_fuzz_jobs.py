"""A job can fail only itself: fuzzed stream entries and fuzzed `Client.submit` calls against a real worker
process on a real redis-server. The worker stays up throughout, every bad entry with an id ends `failed`
with a short error, the valid jobs interleaved with them all succeed, and whatever `Client.submit`
accepts the engine accepts (only the model's own limits, which a client cannot know, may fail it)."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from queue_helpers import log_of, new_queue, redis_server, server_params, start_worker_process, stop_process

from engine.sampling.params import FIELDS, INT64_MAX, INT64_MIN
from producer import Client
from producer import protocol as p

MAX_MODEL_LEN = 48
MAX_ERROR = 2000
# the model's limits: a client cannot know them, so the worker checks them and fails the job
MODEL_LIMITS = ("max_model_len", "vocabulary", "prompt is empty", "chat template")

def _dump(value) -> str:
    return json.dumps(value, allow_nan=True)


ints = st.one_of(st.sampled_from([0, 1, -1, 21, INT64_MAX, INT64_MAX + 1, INT64_MIN, INT64_MIN - 1, 2**64, 10**30]),
                 st.integers())
floats = st.one_of(st.sampled_from([0.0, 1e-300, 0.5, 1.0, 1e308]), st.floats())
scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)
# values each field allows, edges included, so that many fuzzed jobs reach the engine
allowed = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1),
           "top_k": st.sampled_from([-1, 1, 5, INT64_MAX]), "max_tokens": st.sampled_from([1, 3, INT64_MAX]),
           "ignore_eos": st.booleans(), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
           "stop_token_ids": st.lists(st.sampled_from([0, 7, INT64_MAX]), max_size=3),
           "seed": st.sampled_from([None, 0, INT64_MIN, INT64_MAX]), "logprobs": st.sampled_from([None, 0, 20])}
sampling = st.dictionaries(st.sampled_from(sorted(FIELDS) + ["junk"]), json_values, max_size=4)
good_sampling = st.fixed_dictionaries({}, optional=allowed)
some_sampling = st.one_of(good_sampling, good_sampling, sampling)
prompts = st.one_of(st.text(max_size=40), st.just("y" * 300_000), st.lists(ints, max_size=6))
specs = st.fixed_dictionaries(
    {}, optional={"prompt": prompts, "messages": json_values, "prompt_token_ids": st.lists(ints, max_size=6),
                  "sampling": st.one_of(sampling, json_values), "priority": ints, "deadline_s": floats,
                  "stream": json_values, "extra": json_values})
near_valid = st.fixed_dictionaries(  # one good input and fuzzed sampling: these reach the engine
    {"prompt_token_ids": st.one_of(st.lists(st.integers(0, 511), min_size=1, max_size=6), st.lists(ints, max_size=3)),
     "sampling": some_sampling},
    optional={"priority": st.sampled_from(p.PRIORITIES), "stream": st.booleans()})
nested = st.integers(1, 5000).map(lambda depth: "[" * depth + "]" * depth)
job_fields = st.one_of(near_valid.map(_dump), near_valid.map(_dump), specs.map(_dump), nested, st.text(max_size=50),
                       st.binary(max_size=50), st.just("{" * 200_000))


@pytest.mark.parametrize("binary", server_params())
def test_fuzzed_entries_fail_alone_while_interleaved_valid_jobs_succeed(binary):
    with redis_server(binary) as server:
        queue = new_queue()
        keys = p.Keys(queue)
        client = Client(server.url, queue)
        raw = redis.Redis.from_url(server.url)
        worker = start_worker_process(server.url, queue, "fuzz", "--max-model-len", str(MAX_MODEL_LEN),
                                      "--max-job-bytes", "100000")
        counter = itertools.count()
        bad_ids: list[str] = []
        good_ids: list[str] = []

        @settings(max_examples=120, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(job=job_fields, with_id=st.sampled_from([True, True, True, False]), priority=st.sampled_from(p.PRIORITIES))
        def push(job, with_id, priority):
            n = next(counter)
            fields = {"job": job}
            if with_id:
                fields["job_id"] = f"fuzz-{n}"
            entry_id = raw.xadd(keys.jobs(priority), fields).decode()
            bad_ids.append(fields.get("job_id", entry_id))
            good_ids.append(client.submit(prompt_token_ids=[1, 2, n % 50 + 3], job_id=f"good-{n}",
                                          sampling={"max_tokens": 3, "temperature": 0}))

        try:
            push()
            for job_id in bad_ids:
                res = client.result(job_id, timeout=120)
                assert res.status in p.FINAL_STATUSES
                if res.status != p.SUCCEEDED:
                    assert res.error and len(res.error) < MAX_ERROR and "\n" not in res.error, res.error
            assert all(client.result(job_id, timeout=120).ok for job_id in good_ids)
            assert worker.poll() is None, log_of(worker)
            assert "Traceback" not in log_of(worker)
        finally:
            assert stop_process(worker) == 0, log_of(worker)


submit_kwargs = st.fixed_dictionaries(
    {"sampling": some_sampling},
    optional={"priority": st.sampled_from([0, 1, 2, 3, -1]), "deadline_s": st.sampled_from([None, 600.0, math.inf]),
              "stream": st.booleans()})
submit_inputs = st.one_of(st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=30)}),
                          st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, 600), max_size=5)}),
                          st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
                              {"role": st.sampled_from(["user", "assistant", "system"]),
                               "content": st.text(max_size=20)}), max_size=2)}))


def test_whatever_client_submit_accepts_the_engine_accepts():
    with redis_server(server_params()[0].values[0]) as server:
        queue = new_queue()
        client = Client(server.url, queue)
        worker = start_worker_process(server.url, queue, "submit-fuzz", "--max-model-len", str(MAX_MODEL_LEN))
        accepted: list[str] = []

        @settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
        @given(inputs=submit_inputs, kwargs=submit_kwargs)
        def submit(inputs, kwargs):
            kwargs = {**kwargs, "sampling": {**kwargs["sampling"], "max_tokens": 2}}
            try:
                accepted.append(client.submit(**inputs, **kwargs))
            except ValueError as e:  # refused at submit: one short line
                assert "\n" not in str(e) and len(str(e)) < MAX_ERROR

        try:
            submit()
            assert accepted, "every fuzzed submit was refused: the strategy is too narrow"
            for job_id in accepted:
                res = client.result(job_id, timeout=120)
                assert res.ok or any(limit in (res.error or "") for limit in MODEL_LIMITS), res.error
            assert worker.poll() is None, log_of(worker)
        finally:
            assert stop_process(worker) == 0, log_of(worker)
