"""Where the bench workload's time goes: wall time by step kind, and (with --profile) GPU time by kernel.

    PYTHONPATH=. python3 scripts/bench_profile.py --model qwen3-8b [--tensor-parallel-size 2] \
        [--profile] [--out DIR]

Runs nano-vllm's workload once after the bench's warm-up, stepping the engine by hand. Each step's wall
time is booked to "prefill" when the step scheduled prompt tokens, else to "decode". With async
scheduling a step's wall time is mostly the device time of the step launched before it, so the split is
good to one step at each phase change. --profile runs the workload a second time under torch.profiler
(rank 0's GPU only) and sums kernel time by kind; the profiler slows the host, so its wall time is not
the bench's. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from engine import bench

KINDS = (  # first match wins; kernel names are lower-cased
    ("all-reduce", ("all_reduce", "allreduce", "nccl", "one_shot", "pushed_sum")),
    ("all-gather", ("all_gather", "allgather")),
    ("attention decode", ("paged_decode", "decode_reduce", "_decode")),
    ("attention prefill", ("paged_prefill", "prefill")),
    ("qkv preparation", ("qkv",)),
    ("norm / activation", ("rms", "silu", "norm")),
    ("sampling", ("gumbel", "sampl", "argmax", "best")),
    ("gemm", ("gemm", "nvjet", "sm90", "cutlass", "xmma", "matmul")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def run_steps(llm, prompts, params, trace: dict | None = None) -> dict:
    """trace: {first step: (last step, file)}: a Chrome trace of rank 0's GPU over those steps."""
    for p, sp in zip(prompts, params):
        llm.add_request(p, sp)
    wall = defaultdict(float)
    steps = defaultdict(int)
    start = time.perf_counter()
    tracing = None
    index = 0
    while llm.has_unfinished():
        if trace and index in trace:
            activity = torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else torch.profiler.ProfilerActivity.CPU
            tracing = (*trace[index], torch.profiler.profile(activities=[activity]))
            tracing[2].__enter__()
            if hasattr(llm.runner, "trace_ranks"):  # the other tensor-parallel ranks trace the same steps
                llm.runner.trace_ranks(str(tracing[1]).replace("_steps", "_rank{rank}_steps"))
        t = time.perf_counter()
        stats = llm.step(finished_only=True).stats
        if tracing and index == tracing[0]:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            tracing[2].__exit__(None, None, None)
            tracing[2].export_chrome_trace(str(tracing[1]))
            if hasattr(llm.runner, "trace_ranks"):
                llm.runner.trace_ranks(None)
            tracing = None
        index += 1
        kind = "prefill" if stats.num_prefill_tokens else ("decode" if stats.batch_size else "drain")
        wall[kind] += time.perf_counter() - t
        steps[kind] += 1
    total = time.perf_counter() - start
    return {"seconds": round(total, 3), "wall_by_kind": {k: round(v, 3) for k, v in wall.items()},
            "steps_by_kind": dict(steps)}


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default="out")
    parser.add_argument("--trace", default="", metavar="A-B,C-D",
                        help="after the timed run, run the workload again and write a Chrome trace of rank 0's GPU "
                             "for each range of step indices (0 is the first step), e.g. 0-1,400-401")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts, params = bench.make_workload(args)
    llm = bench.build_llm(args)
    bench.warm_up(llm, args)
    cached, wall_start = bench.compiled_kernels(), time.time()
    record = {"gpu": bench.gpu_name(), "commit": bench.git_commit(), "model": args.model,
              "tp": args.tensor_parallel_size, **run_steps(llm, prompts, params)}
    record["kernels_compiled_in_run"] = bench.compiled_kernels() - cached
    if record["kernels_compiled_in_run"]:
        record["kernels_compiled"] = bench.kernels_compiled_since(wall_start)
        bench.warn_if_compiled(record["kernels_compiled_in_run"], record["kernels_compiled"])
    if args.profile:
        args.seed += 2  # fresh prompts of the same distribution: no prefix-cache hits from the first run
        prompts, params = bench.make_workload(args)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            profiled = run_steps(llm, prompts, params)
            torch.cuda.synchronize()
        by_kind = defaultdict(float)
        events = prof.key_averages()
        for e in events:
            device_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            by_kind[kind_of(e.key)] += device_us / 1e6
        record["profiled_seconds"] = profiled["seconds"]
        record["gpu_seconds_by_kind"] = {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
        (out / f"kernels_tp{args.tensor_parallel_size}.txt").write_text(
            events.table(sort_by="device_time_total", row_limit=40, max_name_column_width=90))
    if args.trace:
        args.seed += 1
        prompts, params = bench.make_workload(args)
        ranges = [tuple(int(x) for x in part.split("-")) for part in args.trace.split(",")]
        trace = {a: (b, out / f"trace_tp{args.tensor_parallel_size}_steps{a}-{b}.json") for a, b in ranges}
        record["traced_seconds"] = run_steps(llm, prompts, params, trace)["seconds"]
    print(json.dumps(record), flush=True)
    shutdown = getattr(llm, "shutdown", None)
    if shutdown:
        shutdown()


if __name__ == "__main__":
    main()
