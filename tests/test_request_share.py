"""One request holds at most max_seqs_per_request of the engine's sequence slots (default max_num_seqs // 2):
a wider one is refused in one line when it is added (through the queue: its job fails alone), so a request
that runs until max_model_len never keeps every slot from the others."""
from __future__ import annotations

import pytest

from engine import BeamSearchParams, SamplingParams
from producer import Client
from queue_helpers import new_queue, tiny_engine, url, worker_thread  # noqa: F401 - url is a fixture

SMALL = SamplingParams(temperature=0, max_tokens=4)
UNTIL_FULL = dict(temperature=1.0, max_tokens=None, ignore_eos=True)  # runs until max_model_len


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(max_num_seqs=8)


@pytest.mark.parametrize("params, name", [
    (SamplingParams(n=8, max_tokens=4), "n=8"), (SamplingParams(n=1, best_of=5, max_tokens=4), "best_of=5"),
    (BeamSearchParams(beam_width=5, max_tokens=4), "beam_width=5")])
def test_a_request_wider_than_its_share_is_refused_in_one_line(engine, params, name):
    assert engine.config.max_seqs_per_request == 4
    with pytest.raises(ValueError) as error:
        engine.add_request([1, 2, 3], params)
    message = str(error.value)
    assert message.startswith(f"{name} needs") and "max_num_seqs is 8" in message and "at most 4" in message
    assert "\n" not in message and not engine.has_unfinished()


def test_a_request_at_its_share_runs_beside_a_small_one(engine):
    big = engine.add_request([1, 2, 3], SamplingParams(n=4, **UNTIL_FULL))
    for _ in range(3):
        engine.step()
    small = engine.add_request([4, 5, 6], SMALL)
    finished = {}
    while small not in finished:
        finished.update({o.request_id: o for o in engine.step().finished})
    assert len(finished[small].token_ids) == 4 and big not in finished  # the small one never waited for it
    engine.abort(big)
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("share, ok", [(8, True), (9, False), (0, False)])
def test_the_share_is_an_engine_option_within_max_num_seqs(share, ok):
    if ok:
        engine = tiny_engine(max_num_seqs=8, max_seqs_per_request=share)
        out = engine.generate([[1, 2]], SamplingParams(n=8, max_tokens=2), use_tqdm=False)[0]
        assert len(out.outputs) == 8
    else:
        with pytest.raises(ValueError, match="max_seqs_per_request"):
            tiny_engine(max_num_seqs=8, max_seqs_per_request=share)


def test_through_the_queue_a_wide_job_fails_alone_and_a_big_one_leaves_room(url):  # noqa: F811
    with Client(url, new_queue()) as client, worker_thread(url, client.keys.queue, tiny_engine(max_num_seqs=8)):
        wide = client.submit(prompt_token_ids=[1, 2, 3], sampling={"n": 8, **UNTIL_FULL})
        big = client.submit(prompt_token_ids=[1, 2, 3], sampling={"n": 4, **UNTIL_FULL})
        small = client.submit(prompt_token_ids=[4, 5, 6], sampling={"temperature": 0, "max_tokens": 4})
        failed = client.result(wide, timeout=60)
        assert failed.status == "failed" and failed.error.startswith("n=8 needs 8 sequences at once")
        assert "max_seqs_per_request" in failed.error and "\n" not in failed.error
        done = client.result(small, timeout=60)
        assert done.status == "succeeded" and len(done.token_ids) == 4
        assert client.status(big).status == "running"  # the big job still runs: the small one did not wait
        client.cancel(big)
        assert client.result(big, timeout=60).status == "cancelled"
