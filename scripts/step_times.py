"""Decode step time at fixed batch sizes: the fixed cost of a step against the part that grows with work.

    PYTHONPATH=. python3 scripts/step_times.py --model qwen3-0.6b --batches 1,16,64,256 \
        [--tensor-parallel-size 2] [--profile-batch 256] [--out DIR]

For each batch size B: B fresh prompts of --prompt-len ids, run once to one new token (prefill and one
step) and once to 1 + --steps tokens; the difference over --steps is the time of one decode step at B
sequences. With --profile-batch, a kernel table of --steps decode steps at that size (rank 0's process).
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from engine import bench


def _prompts(rng: random.Random, count: int, length: int, max_id: int) -> list[list[int]]:
    return [[rng.randint(0, max_id) for _ in range(length)] for _ in range(count)]


def _timed_generate(llm, prompts, max_tokens: int, temperature: float) -> float:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=max_tokens)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def _kernel_table(llm, prompts, steps: int, temperature: float, out: Path) -> str:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=steps + 40)
    for p in prompts:
        llm.add_request(p, params)
    for _ in range(20):  # past the prefill
        llm.step(finished_only=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            llm.step(finished_only=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    while llm.has_unfinished():
        llm.step(finished_only=True)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    (out / "kernels.txt").write_text(table)
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--profile-batch", type=int, default=0)
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    if args.max_num_seqs is None:
        args.max_num_seqs = max(batches + [args.profile_batch])
    llm = bench.build_llm(args)
    rng = random.Random(args.seed)
    record = {"gpu": bench.gpu_name(), "commit": bench.git_commit(), "model": args.model,
              "tp": args.tensor_parallel_size, "prompt_len": args.prompt_len, "steps": args.steps,
              "ms_per_step": {}}
    for b in batches:
        make = lambda: _prompts(rng, b, args.prompt_len, args.max_token_id)  # noqa: E731 (fresh ids: no cache hits)
        _timed_generate(llm, make(), args.steps + 1, args.temperature)  # warm-up: kernels for this size
        one = _timed_generate(llm, make(), 1, args.temperature)
        many = _timed_generate(llm, make(), args.steps + 1, args.temperature)
        ms = (many - one) / args.steps * 1e3
        record["ms_per_step"][b] = round(ms, 3)
        print(f"batch {b:4d}: {ms:7.3f} ms per decode step ({b / ms * 1e3:,.0f} tok/s)", flush=True)
    if args.profile_batch:
        print(_kernel_table(llm, _prompts(rng, args.profile_batch, args.prompt_len, args.max_token_id),
                            args.steps, args.temperature, out))
    print(json.dumps(record), flush=True)
    shutdown = getattr(llm, "shutdown", None)
    if shutdown:
        shutdown()


if __name__ == "__main__":
    main()
