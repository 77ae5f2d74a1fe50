"""Where the time of `redline bench` goes: per-phase totals over the nano-bench workload, and a
kernel table of a few decode steps. Run on the GPU machine: python3 scripts/profile_bench.py --out DIR"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

from engine import bench


def timed(totals: dict, name: str, fn, sync: bool):
    def wrapper(*args, **kwargs):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if sync:
            torch.cuda.synchronize()
        totals[name] += time.perf_counter() - start
        return out
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts, params = bench.make_workload(args)
    llm = bench.build_llm(args)
    bench.warm_up(llm, args)
    totals: dict[str, float] = defaultdict(float)
    runner = llm.runner
    llm.scheduler.schedule = timed(totals, "schedule", llm.scheduler.schedule, False)
    runner.prepare_inputs = timed(totals, "prepare_inputs", runner.prepare_inputs, False)
    llm._sampling_tensors = timed(totals, "sampling_tensors", llm._sampling_tensors, False)
    llm._postprocess = timed(totals, "postprocess", llm._postprocess, False)
    runner.forward = timed(totals, "forward (GPU)", runner.forward, True)
    runner.compute_logits = timed(totals, "logits (GPU)", runner.compute_logits, True)
    runner.sample_async = timed(totals, "sample (GPU)", runner.sample_async, True)
    for p, sp in zip(prompts, params):
        llm.add_request(p, sp)
    steps = decode_steps = 0
    start = time.perf_counter()
    profiled = False
    while llm.has_unfinished():
        res = llm.step(finished_only=True)
        steps += 1
        decode_steps += res.stats.num_prefill_tokens == 0
        if decode_steps == 300 and not profiled:
            profiled = True
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    llm.step(finished_only=True)
                    steps += 1
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
            (out / "kernels.txt").write_text(table)
    wall = time.perf_counter() - start
    lines = [f"steps {steps} (decode-only {decode_steps}), wall {wall:.2f} s (phases synced: slower than the bench)"]
    for name, secs in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(f"{name:24s} {secs:7.3f} s  {secs / steps * 1e3:6.3f} ms/step")
    lines.append(f"{'other':24s} {wall - sum(totals.values()):7.3f} s")
    text = "\n".join(lines)
    (out / "phases.txt").write_text(text)
    print(text)
    print((out / "kernels.txt").read_text() if (out / "kernels.txt").exists() else "")


if __name__ == "__main__":
    main()
