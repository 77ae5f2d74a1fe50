"""`redline bench --shared-prefixes`: cache-aware admission against arrival order, through the queue.

Workload (issue 55): random.seed(seed); 16 system prompts of 2,000 ids each; 64 jobs per system prompt, each
the system prompt and a user part of randint(100, 300) ids, max_tokens randint(128, 512), ignore_eos; the
1,024 jobs shuffled. The KV cache holds about four system prompts' worth of running sequences, each with 16
of its jobs: 4 x (2,000 + 16 x (200 + 320)) = 41,280 tokens, in whole blocks, so arrival order (every system
prompt's jobs running at once) evicts system prompts that grouped admission (one or two at a time) keeps.

One engine, one process, after a warm-up; the prefix cache is emptied before each run:
  arrival   the worker reads as much as the engine has room for, the scheduler admits first come first
  aware     --cache-aware-admission: the worker reads ahead and the scheduler prefers cached prefixes
Each run reports output tokens per second (first submit to last result) and the prompt tokens the engine
computed against the ideal: each system prompt's cacheable blocks once, and every job's remainder.
"""
from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path


@dataclass(frozen=True)
class SharedPrefixes:
    """The workload's shape (the issue's; tests use a smaller one)."""

    num_prefixes: int = 16
    prefix_len: int = 2000
    jobs_per_prefix: int = 64
    user_len: tuple[int, int] = (100, 300)
    output_len: tuple[int, int] = (128, 512)
    running_prefixes: int = 4  # the KV cache holds this many prefixes,
    running_per_prefix: int = 16  # each with this many of its jobs running

    def kv_blocks(self, block_size: int) -> int:
        mean_user, mean_output = sum(self.user_len) / 2, sum(self.output_len) / 2
        tokens = self.running_prefixes * (self.prefix_len + self.running_per_prefix * (mean_user + mean_output))
        return math.ceil(tokens / block_size)

    def jobs(self, seed: int, max_token_id: int) -> list[dict]:
        """The shuffled jobs, as `Client.submit_many` takes them (greedy, so both runs give the same tokens)."""
        rng = random.Random(seed)
        prefixes = [[rng.randint(0, max_token_id) for _ in range(self.prefix_len)] for _ in range(self.num_prefixes)]
        def user_part() -> list[int]:
            return [rng.randint(0, max_token_id) for _ in range(rng.randint(*self.user_len))]

        jobs = [{"prompt_token_ids": prefix + user_part(),
                 "sampling": {"temperature": 0.0, "ignore_eos": True, "max_tokens": rng.randint(*self.output_len)},
                 "stream": False}
                for prefix in prefixes for _ in range(self.jobs_per_prefix)]
        rng.shuffle(jobs)
        return jobs

    def ideal_prompt_tokens(self, jobs: list[dict], block_size: int) -> int:
        """Each prefix's whole blocks computed once (a hit is block by block), every job's remainder."""
        shared = self.prefix_len // block_size * block_size
        return sum(len(j["prompt_token_ids"]) - shared for j in jobs) + self.num_prefixes * shared


def run(opts: argparse.Namespace, url: str, workload: SharedPrefixes = SharedPrefixes()) -> dict:
    """Both runs on one engine; the JSON record."""
    from engine.config import EngineConfig
    from worker import bench_engine as engine_bench

    from .bench import forget_prefix_cache, through_queue

    block_size = opts.kvcache_block_size or EngineConfig(opts.model, load_format=opts.load_format,
                                                         device=opts.device).kvcache_block_size
    opts.kvcache_block_size, opts.num_kvcache_blocks = block_size, workload.kv_blocks(block_size)
    llm = engine_bench.build_llm(opts)
    engine_bench.warm_up(llm, opts)
    jobs = workload.jobs(opts.seed, opts.max_token_id)
    ideal = workload.ideal_prompt_tokens(jobs, block_size)
    record = {"gpu": engine_bench.gpu_name(), "commit": engine_bench.git_commit(opts.commit),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
              "model": Path(engine_bench.resolve_model(opts.model)).name, "jobs": len(jobs),
              "kv_blocks": opts.num_kvcache_blocks, "block_size": block_size, "ideal_prompt_tokens": ideal}
    for name, aware in (("arrival", False), ("aware", True)):
        forget_prefix_cache(llm)
        llm.scheduler.prefer_cached = aware
        bm = llm.block_manager
        queries, hits, preempted = bm.num_cache_queries, bm.num_cache_hits, llm.scheduler.num_preemptions
        settings = {"cache_aware_admission": aware}
        if aware and opts.admission_max_wait is not None:
            settings["admission_max_wait"] = opts.admission_max_wait
        start = time.perf_counter()
        seconds, tokens = through_queue(llm, url, jobs, opts, worker_settings=settings)
        computed = (bm.num_cache_queries - queries) - (bm.num_cache_hits - hits)
        preempted = llm.scheduler.num_preemptions - preempted
        print(f"{name:8s} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s; prompt tokens "
              f"computed {computed:,} = {computed / ideal:.2f} x the ideal {ideal:,}; {preempted} preemptions "
              f"({time.perf_counter() - start:.0f} s with the warm-up)", flush=True)
        record.update({f"{name}_tokens": tokens, f"{name}_seconds": round(seconds, 3),
                       f"{name}_tok_s": round(tokens / seconds, 1), f"{name}_prompt_tokens": computed,
                       f"{name}_vs_ideal": round(computed / ideal, 3), f"{name}_preemptions": preempted})
    record["aware_vs_arrival"] = round(record["aware_tok_s"] / record["arrival_tok_s"], 3)
    print(f"cache-aware: {record['aware_vs_arrival']:.3f}x the throughput of arrival order", flush=True)
    return record
