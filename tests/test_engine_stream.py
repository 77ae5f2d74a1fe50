"""The step() loop as the worker drives it: deltas, late arrivals, aborts."""
import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(qwen3_checkpoint, request):
    return LLM(str(qwen3_checkpoint), device="cpu", kvcache_block_size=8, async_scheduling=request.param)


def test_deltas_concatenate_to_the_final_tokens_with_requests_arriving_midway(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    prompts = {f"r{i}": [10 + i, 20 + i, 30 + i] * (i + 1) for i in range(6)}
    expected = {rid: llm.generate([p], greedy, use_tqdm=False)[0].token_ids for rid, p in prompts.items()}
    deltas = {rid: [] for rid in prompts}
    finals = {}
    pending = list(prompts.items())
    while pending or llm.has_unfinished():
        if pending:  # one new request per step, while others run
            rid, p = pending.pop(0)
            llm.add_request(p, greedy, request_id=rid)
        for out in llm.step().outputs:
            assert -1 not in out.new_token_ids and -1 not in out.token_ids
            deltas[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    assert {rid: o.token_ids for rid, o in finals.items()} == expected
    assert deltas == expected
    assert all(o.finish_reason == "length" for o in finals.values())


def test_finished_only_steps_report_streaming_requests_every_step_and_the_others_once(llm):
    """The worker's loop: step(finished_only=True) reports a request added with stream=True at every step
    that gave it tokens (its deltas add up to its tokens), and the others only when they finish."""
    greedy = SamplingParams(temperature=0, max_tokens=10)
    llm.add_request([11, 12, 13], greedy, request_id="streams", stream=True)
    llm.add_request([14, 15, 16], greedy, request_id="quiet")
    reports = {"streams": [], "quiet": []}
    while llm.has_unfinished():
        for out in llm.step(finished_only=True).outputs:
            reports[out.request_id].append(out)
    assert [o.finished for o in reports["quiet"]] == [True]
    assert len(reports["streams"]) == 10 and reports["streams"][-1].finished
    assert [t for o in reports["streams"] for t in o.new_token_ids] == reports["streams"][-1].token_ids


def test_abort_midway_reports_abort_and_frees_every_block(llm):
    rid = llm.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=50))
    other = llm.add_request([9, 10], SamplingParams(temperature=0, max_tokens=5))
    seen = []
    for _ in range(4):
        seen += [t for o in llm.step().outputs if o.request_id == rid for t in o.new_token_ids]
    assert llm.abort(rid)
    finals = {}
    while llm.has_unfinished():
        for o in llm.step().outputs:
            if o.finished:
                finals[o.request_id] = o
    assert finals[rid].finish_reason == "abort" and finals[rid].token_ids == seen[: len(finals[rid].token_ids)]
    assert -1 not in finals[rid].token_ids
    assert finals[other].finish_reason == "length" and len(finals[other].token_ids) == 5
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_shutdown_frees_the_cache_and_weights_at_once_and_refuses_later_steps(qwen3_checkpoint, async_scheduling):
    import gc
    import weakref

    engine = LLM(str(qwen3_checkpoint), device="cpu", kvcache_block_size=8, async_scheduling=async_scheduling)
    engine.add_request([3, 4, 5], SamplingParams(temperature=0, max_tokens=20))
    engine.step()
    engine.step()  # a request still running, and with async scheduling a step in flight
    cache, weight = weakref.ref(engine.runner.kv_cache), weakref.ref(next(engine.runner.model.parameters()))
    gc.collect()
    gc.disable()  # freed by shutdown itself, not by a later collection
    try:
        engine.shutdown()
        assert cache() is None and weight() is None
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    engine.shutdown()  # idempotent
