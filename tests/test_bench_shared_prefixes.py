"""`redline bench --shared-prefixes` (worker/bench_prefixes.py): the issue's workload, and both runs on the tiny
model through a real redis-server, cache-aware computing fewer prompt tokens than arrival order."""
from __future__ import annotations

from collections import Counter

from engine.builtin import TINY_MODEL_DIR
from producer.embedded import RedisServer
from queue_helpers import one_torch_thread
from worker.bench import build_parser
from worker.bench_prefixes import SharedPrefixes, run


def test_the_workload_is_sixteen_system_prompts_of_sixty_four_shuffled_jobs():
    workload = SharedPrefixes()
    jobs = workload.jobs(seed=0, max_token_id=10000)
    prefixes = Counter(tuple(j["prompt_token_ids"][:2000]) for j in jobs)
    assert len(jobs) == 1024 and len(prefixes) == 16 and set(prefixes.values()) == {64}
    assert all(100 <= len(j["prompt_token_ids"]) - 2000 <= 300 for j in jobs)
    assert all(128 <= j["sampling"]["max_tokens"] <= 512 and j["sampling"]["ignore_eos"] for j in jobs)
    assert len({tuple(j["prompt_token_ids"][:2000]) for j in jobs[:16]}) > 4  # shuffled, not grouped
    # four system prompts' worth of running sequences: 4 x (2,000 + 16 x (200 + 320)) tokens in 256-token blocks
    assert workload.kv_blocks(256) == 162


def test_both_runs_report_throughput_and_prompt_tokens_against_the_ideal(capsys):
    opts = build_parser().parse_args(["--shared-prefixes", "--model", str(TINY_MODEL_DIR), "--device", "cpu",
                                      "--num-seqs", "4", "--min-input-len", "8", "--max-input-len", "16",
                                      "--min-output-len", "2", "--max-output-len", "4", "--max-token-id", "400",
                                      "--max-model-len", "128", "--max-num-seqs", "2", "--kvcache-block-size", "16"])
    small = SharedPrefixes(num_prefixes=4, prefix_len=96, jobs_per_prefix=5, user_len=(3, 12), output_len=(2, 4),
                           running_prefixes=2, running_per_prefix=5)
    with one_torch_thread(), RedisServer() as server:
        record = run(opts, server.url, small)
    assert record["jobs"] == 20 and record["kv_blocks"] == small.kv_blocks(16)
    assert record["aware_tokens"] == record["arrival_tokens"] > 0
    assert record["aware_vs_ideal"] <= 1.2 < record["arrival_vs_ideal"]
    assert "x the throughput of arrival order" in capsys.readouterr().out
