"""monitoring.metrics: what the worker's hooks put into its registry, and the /metrics endpoint."""
from __future__ import annotations

import socket
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from monitoring.metrics import Metrics, start_metrics_server

LABELS = {"queue": "q1", "model_name": "tiny"}


def step_stats(**overrides):
    stats = dict(num_prefill_tokens=0, num_decode_tokens=0, num_running=0, num_waiting=0,
                 kv_cache_usage=0.0, num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0,
                 step_seconds=0.01, batch_size=1)
    stats.update(overrides)
    return SimpleNamespace(**stats)


def finished_output(**overrides):
    out = dict(request_id="r1", prompt_token_ids=[1, 2, 3, 4], token_ids=[5, 6, 7, 8, 9],
               finish_reason="length", num_cached_tokens=0, arrival_time=100.0,
               first_scheduled_time=100.5, first_token_time=101.0, finished_time=103.0)
    out.update(overrides)
    return SimpleNamespace(**out)


def value(metrics: Metrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, {**LABELS, **labels})


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(queue="q1", model="tiny")


def test_two_instances_in_one_process_keep_separate_counts():
    a, b = Metrics(queue="q1", model="tiny"), Metrics(queue="q1", model="tiny")
    a.job_received(3)
    b.job_received(1)
    assert value(a, "redline_jobs_received_total", source="redline") == 3
    assert value(b, "redline_jobs_received_total", source="redline") == 1


def test_step_stats_update_gauges_and_accumulate_counters(metrics):
    metrics.observe_step(step_stats(num_prefill_tokens=40, num_running=3, num_waiting=2,
                                    kv_cache_usage=0.25, prefix_cache_queries=40, prefix_cache_hits=16,
                                    num_preemptions=1, batch_size=3, step_seconds=0.02))
    metrics.observe_step(step_stats(num_decode_tokens=3, num_running=3, kv_cache_usage=0.5, batch_size=3))
    assert value(metrics, "redline_num_requests_running") == 3
    assert value(metrics, "redline_num_requests_waiting") == 0
    assert value(metrics, "redline_kv_cache_usage_perc") == 0.5
    assert value(metrics, "redline_prompt_tokens_total") == 40
    assert value(metrics, "redline_generation_tokens_total") == 3
    assert value(metrics, "redline_prefix_cache_queries_total") == 40
    assert value(metrics, "redline_prefix_cache_hits_total") == 16
    assert value(metrics, "redline_num_preemptions_total") == 1
    assert value(metrics, "redline_engine_step_seconds_count") == 2
    assert value(metrics, "redline_engine_step_seconds_sum") == pytest.approx(0.03)
    assert value(metrics, "redline_engine_batch_size_sum") == 6


def test_finished_request_records_latencies_once(metrics):
    metrics.observe_finished(finished_output())
    assert value(metrics, "redline_request_success_total", finished_reason="length") == 1
    assert value(metrics, "redline_time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value(metrics, "redline_e2e_request_latency_seconds_sum") == pytest.approx(3.0)
    # 5 tokens, 2 s from the first to the last: 4 gaps of 0.5 s, observed as one sample
    assert value(metrics, "redline_inter_token_latency_seconds_count") == 1
    assert value(metrics, "redline_inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert value(metrics, "redline_request_prompt_tokens_sum") == 4
    assert value(metrics, "redline_request_generation_tokens_sum") == 5


def test_request_aborted_before_first_token_counts_without_ttft(metrics):
    metrics.observe_finished(finished_output(finish_reason="abort", token_ids=[], first_token_time=None))
    assert value(metrics, "redline_request_success_total", finished_reason="abort") == 1
    assert value(metrics, "redline_time_to_first_token_seconds_count") == 0
    assert value(metrics, "redline_inter_token_latency_seconds_count") == 0
    assert value(metrics, "redline_e2e_request_latency_seconds_count") == 1


def test_single_token_request_has_ttft_but_no_inter_token_latency(metrics):
    metrics.observe_finished(finished_output(token_ids=[5], finish_reason="stop"))
    assert value(metrics, "redline_time_to_first_token_seconds_count") == 1
    assert value(metrics, "redline_inter_token_latency_seconds_count") == 0


def test_queue_hooks(metrics):
    metrics.observe_queue_time(2.5)
    metrics.job_received()
    for status in ("succeeded", "succeeded", "failed", "cancelled", "expired"):
        metrics.job_completed(status)
    metrics.job_redelivered(2)
    metrics.job_dead_lettered()
    metrics.set_queue_depth("0", 7)
    metrics.set_queue_depth("1", 2)
    metrics.set_pending(4)
    metrics.heartbeat()
    assert value(metrics, "redline_request_queue_time_seconds_sum") == 2.5
    assert value(metrics, "redline_jobs_completed_total", status="succeeded", source="redline") == 2
    assert value(metrics, "redline_jobs_completed_total", status="expired", source="redline") == 1
    assert value(metrics, "redline_jobs_redelivered_total", source="redline") == 2
    assert value(metrics, "redline_jobs_dead_lettered_total", source="redline") == 1
    assert value(metrics, "redline_queue_stream_length", priority="0") == 7
    assert value(metrics, "redline_queue_stream_length", priority="1") == 2
    assert value(metrics, "redline_queue_pending_entries") == 4
    assert value(metrics, "redline_worker_heartbeat_timestamp_seconds") > 1.6e9


def test_job_counters_tell_the_source_apart(metrics):
    metrics.job_received(2)
    metrics.job_received(source="celery")
    metrics.job_completed("succeeded", source="celery")
    metrics.job_completed("failed")
    assert value(metrics, "redline_jobs_received_total", source="redline") == 2
    assert value(metrics, "redline_jobs_received_total", source="celery") == 1
    assert value(metrics, "redline_jobs_completed_total", status="succeeded", source="celery") == 1
    assert value(metrics, "redline_jobs_completed_total", status="succeeded", source="redline") == 0
    assert value(metrics, "redline_jobs_completed_total", status="failed", source="redline") == 1
    assert value(metrics, "redline_jobs_completed_total", status="failed", source="celery") is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_server_serves_this_instance_only():
    served, other = Metrics(queue="served"), Metrics(queue="other")
    served.job_received(5)
    other.job_received(9)
    port = free_port()
    start_metrics_server(port, served)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = {(s.name, s.labels.get("queue")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("redline_jobs_received_total", "served")] == 5
    assert ("redline_jobs_received_total", "other") not in samples


# -- fed by the real engine --------------------------------------------------------------------------

def run_engine(metrics: Metrics, prompts: list[list[int]], max_tokens: int, **engine_kwargs) -> list:
    """Drive a tiny real engine to completion through the hooks the worker calls; return finished outputs."""
    from engine import LLMEngine, SamplingParams
    from engine.builtin import TINY_MODEL_DIR

    engine = LLMEngine(TINY_MODEL_DIR, load_format="dummy", device="cpu", max_model_len=256, **engine_kwargs)
    finished = []
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=f"r{i}")
        if engine_kwargs.get("max_num_seqs") == 1:  # one at a time, so later prompts can hit the cache
            finished += drain(engine, metrics)
    finished += drain(engine, metrics)
    return finished


def drain(engine, metrics: Metrics) -> list:
    finished = []
    while engine.has_unfinished():
        result = engine.step()
        metrics.observe_step(result.stats)
        for out in result.finished:
            metrics.observe_finished(out)
            finished.append(out)
    return finished


def test_engine_run_counts_every_prompt_and_generated_token(metrics):
    prompts = [[i + 1] * (20 + 3 * i) for i in range(4)]
    finished = run_engine(metrics, prompts, max_tokens=6, max_num_seqs=8)
    assert len(finished) == 4
    assert value(metrics, "redline_prompt_tokens_total") == sum(len(p) for p in prompts)
    assert value(metrics, "redline_generation_tokens_total") == sum(len(o.token_ids) for o in finished) == 24
    assert value(metrics, "redline_request_success_total", finished_reason="length") == 4
    assert value(metrics, "redline_time_to_first_token_seconds_count") == 4
    assert value(metrics, "redline_inter_token_latency_seconds_count") == 4
    assert value(metrics, "redline_e2e_request_latency_seconds_count") == 4
    assert value(metrics, "redline_num_requests_running") == 0
    assert value(metrics, "redline_kv_cache_usage_perc") == 0


def test_repeated_prompt_shows_as_prefix_cache_hits_not_prompt_work(metrics):
    prompt = list(range(1, 65))  # four full 16-token blocks
    run_engine(metrics, [prompt, prompt], max_tokens=2, max_num_seqs=1)
    hits = value(metrics, "redline_prefix_cache_hits_total")
    assert hits > 0
    assert value(metrics, "redline_prefix_cache_queries_total") == 2 * len(prompt)
    assert value(metrics, "redline_prompt_tokens_total") == 2 * len(prompt) - hits
    # the second request's prefill saved, per job: its prompt's cached blocks (the first saved none)
    assert value(metrics, "redline_request_prefix_cached_tokens_count") == 2
    assert value(metrics, "redline_request_prefix_cached_tokens_sum") == hits == 48
    assert value(metrics, "redline_request_prefix_cached_tokens_bucket", le="0.0") == 1
