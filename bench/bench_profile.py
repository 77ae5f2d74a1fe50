"""Reproduces docs/performance.md's split of nano-bench: each decode step's wall time booked by its rows against
that range's floor, and (--profile) the GPU time by kernel kind.
    python3 bench/bench_profile.py [--profile] [--trace 30-30,500-500] [--out DIR] [worker.bench_engine's options]

Runs nano-vllm's workload once after the bench's warm-up, stepping the engine by hand. Each step's wall
time is booked to "prefill" when the step scheduled prompt tokens, else to "decode". With async
scheduling a step's wall time is mostly the device time of the step launched before it, so the split is
good to one step at each phase change. --profile runs the workload a second time under torch.profiler
(rank 0's GPU only) and sums kernel time by kind; the profiler slows the host, so its wall time is not
the bench's, and a kernel launched with programmatic dependent launch may start inside the one before it
and wait there, so kernel sums overlap (bench/decode_attention.py times the attention alone). --trace
writes Chrome traces of chosen steps on every rank (bench/trace_summary.py reads them). Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tree this script is in

from worker import bench_engine as bench  # noqa: E402

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


ROW_BUCKETS = (8, 32, 64, 128, 192, 256)  # decode steps booked by rows: 1-8, 9-32, ..., 193-256, more


def by_rows(decode: list[tuple[int, int, float]], hf_config, bandwidth: float | None) -> dict:
    """Decode steps (rows, context tokens read, seconds) summed by row range, with the floor of each range:
    its contexts' K/V and the weights once a step, at `bandwidth`. A step's seconds are those of the call
    after it (with async scheduling a call waits for the step launched before it)."""
    kv_bytes = bench.kv_bytes_per_token(hf_config)
    weight_bytes = bench.count_parameters(hf_config) * 2
    ranges = [(low + 1, high) for low, high in zip((0,) + ROW_BUCKETS, ROW_BUCKETS)]
    names = [f"{low}-{high}" for low, high in ranges] + [f">{ROW_BUCKETS[-1]}"]
    table = {name: {"steps": 0, "seconds": 0.0, "floor_seconds": 0.0} for name in names}
    for (rows, context, _), (_, _, seconds) in zip(decode, decode[1:]):
        entry = table[next((n for n, (_, high) in zip(names, ranges) if rows <= high), names[-1])]
        entry["steps"] += 1
        entry["seconds"] += seconds
        if bandwidth:
            entry["floor_seconds"] += (context * kv_bytes + weight_bytes) / bandwidth
    for entry in table.values():
        entry["excess_seconds"] = entry["seconds"] - entry["floor_seconds"]
        entry.update({k: round(v, 4) for k, v in entry.items() if isinstance(v, float)})
    return {name: entry for name, entry in table.items() if entry["steps"]}


def run_steps(llm, prompts, params, trace: dict | None = None, decode: list | None = None) -> dict:
    """trace: {first step: (last step, file, other ranks' file with {rank})}: Chrome traces of every rank's
    GPU over those steps. decode: a list to append (rows, context tokens, call seconds) to for each decode
    step (see by_rows)."""
    for p, sp in zip(prompts, params):
        llm.add_request(p, sp)
    wall = defaultdict(float)
    steps = defaultdict(int)
    traces_ranks = hasattr(llm.runner, "trace_ranks")  # a tensor-parallel engine: its other ranks trace too
    start = time.perf_counter()
    profiler, last, file = None, -1, None
    index = 0
    while llm.has_unfinished():
        if trace and index in trace:
            last, file, rank_file = trace[index]
            activities = [torch.profiler.ProfilerActivity.CPU]  # the host's annotated phases (annotate_host)
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
            if traces_ranks:
                llm.runner.trace_ranks(rank_file)
        running = llm.scheduler.running if decode is not None else ()
        rows, context = len(running), sum(len(seq) for seq in running)
        t = time.perf_counter()
        stats = llm.step(finished_only=True).stats
        if profiler is not None and index == last:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            profiler.__exit__(None, None, None)
            profiler.export_chrome_trace(str(file))
            if traces_ranks:
                llm.runner.trace_ranks(None)
            profiler = None
        index += 1
        kind = "prefill" if stats.num_prefill_tokens else ("decode" if stats.batch_size else "drain")
        wall[kind] += time.perf_counter() - t
        steps[kind] += 1
        if decode is not None and kind == "decode":
            decode.append((rows, context, time.perf_counter() - t))
    total = time.perf_counter() - start
    return {"seconds": round(total, 3), "wall_by_kind": {k: round(v, 3) for k, v in wall.items()},
            "steps_by_kind": dict(steps)}


HOST_PHASES = (("scheduler", "schedule"), ("steps", "build"), ("runner", "execute_model"), ("runner", "sample_tokens"))


def annotate_host(llm) -> None:
    """Name the engine's host phases in traces: each method of HOST_PHASES runs inside a profiler range
    ("host: schedule", ...), which trace_summary.py --gaps matches against the device's idle stretches."""
    for owner_name, method in HOST_PHASES:
        owner = getattr(llm, owner_name)
        inner = getattr(owner, method, None)
        if inner is None:  # a tensor-parallel driver without this phase: nothing to name
            continue

        def wrapped(*args, _inner=inner, _label=f"host: {method}", **kwargs):
            with torch.profiler.record_function(_label):
                return _inner(*args, **kwargs)
        setattr(owner, method, wrapped)


def step_ranges(text: str) -> list[tuple[int, int]]:
    """'0-1,400-401' -> [(0, 1), (400, 401)]: first and last step of each range, not overlapping."""
    ranges = []
    for part in text.split(","):
        bounds = part.split("-")
        if len(bounds) != 2 or not all(b.isdigit() for b in bounds) or int(bounds[0]) > int(bounds[1]):
            raise argparse.ArgumentTypeError(f"{part!r} is no range of steps like 20-21")
        ranges.append((int(bounds[0]), int(bounds[1])))
    ranges.sort()
    if any(b[0] <= a[1] for a, b in zip(ranges, ranges[1:])):
        raise argparse.ArgumentTypeError(f"step ranges overlap: {text}")
    return ranges


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default="out")
    parser.add_argument("--trace", default=[], type=step_ranges, metavar="A-B,C-D",
                        help="after the timed run, run the workload again and write a Chrome trace of every rank's GPU "
                             "for each range of step indices (0 is the first step), e.g. 0-1,400-401")
    args = parser.parse_args()
    bench.check_arguments(args)  # prompt ids cut to the model's vocabulary, as the bench draws them
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts, params = bench.make_workload(args)
    llm = bench.build_llm(args)
    bench.warm_up(llm, args)
    compiles = bench.watch_compiles()
    decode = []
    commit = bench.git_commit(getattr(args, "commit", None))
    record = {"gpu": bench.gpu_name(), "commit": commit, "model": args.model,
              "tp": args.tensor_parallel_size, **run_steps(llm, prompts, params, decode=decode)}
    bandwidth = args.bandwidth or bench.default_bandwidth(record["gpu"])
    record["decode_by_rows"] = by_rows(decode, llm.config.hf_config, bandwidth)
    record["kernels_compiled_in_run"], names = compiles()
    if names:
        record["kernels_compiled"] = names
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
        tp = args.tensor_parallel_size
        trace = {a: (b, out / f"trace_tp{tp}_steps{a}-{b}.json", str(out / f"trace_tp{tp}_rank{{rank}}_steps{a}-{b}.json"))
                 for a, b in args.trace}
        annotate_host(llm)
        record["traced_seconds"] = run_steps(llm, prompts, params, trace)["seconds"]
    print(json.dumps(record), flush=True)
    shutdown = getattr(llm, "shutdown", None)
    if shutdown:
        shutdown()


if __name__ == "__main__":
    main()
