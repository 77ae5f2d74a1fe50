"""A job's sampling settings are checked once on each side of the wire: by the client when it submits, and by
the worker when it parses the job (a constraint's compile check on its preparation threads). The engine
thread then builds the job's SamplingParams from those checked values without checking them again."""
from __future__ import annotations

import threading

import pytest
from queue_helpers import (
    new_queue,
    tiny_engine,
    url,  # noqa: F401 - the fixture: a module's Redis, on each server
    worker_thread,
)

from engine.sampling import params as sampling_params
from producer import Client
from worker import prepare


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(max_num_seqs=4)


@pytest.fixture
def checks(monkeypatch) -> list[str]:
    """The fields check_field is called for from now on: by the wire's Sampling, SamplingParams and the
    preparation threads."""
    calls: list[str] = []
    lock = threading.Lock()
    real = sampling_params.check_field

    def counted(name, value, *args, **kwargs):
        with lock:
            calls.append(name)
        return real(name, value, *args, **kwargs)

    monkeypatch.setattr(sampling_params, "check_field", counted)
    monkeypatch.setattr(prepare, "check_field", counted)
    return calls


@pytest.mark.parametrize("sampling, expected", [
    ({"temperature": 0.0, "max_tokens": 5, "stop": ["zz"]}, ["max_tokens", "stop", "temperature"]),
    # the worker's parse checks the regex's shape and size; its preparation, the compile check it deferred
    ({"temperature": 0.0, "max_tokens": 4, "regex": "[ab]+"}, ["max_tokens", "regex", "regex", "temperature"]),
], ids=["plain", "constrained"])
def test_the_worker_checks_a_jobs_sampling_once_and_the_engine_takes_it_as_checked(url, engine, checks, sampling,
                                                                                   expected):
    with Client(url, new_queue()) as client:
        job_id = client.submit(prompt_token_ids=[5, 6, 7], sampling=sampling)
        checks.clear()  # the client's checks: the other side of the wire
        with worker_thread(url, client.keys.queue, engine):
            result = client.result(job_id, timeout=60)
    assert result.status == "succeeded", result.error
    assert 0 < len(result.token_ids) <= sampling["max_tokens"]
    assert sorted(checks) == expected
