"""Reproduces docs/performance.md's time to a lone prompt's first token: the wall time of a one-token generate, the
host time of its prefill forward (Python and launches) and its device time; --enforce-eager for the eager prefill.
    python3 bench/first_token.py [--lengths 16,128,512,2048] [--repeats 5] [--enforce-eager] [worker.bench_engine's options]

Each repeat uses a fresh prompt (no prefix-cache hit). Prints one JSON line of medians in ms by length.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tree this script is in

from engine.sampling.params import SamplingParams  # noqa: E402
from worker import bench_engine as bench  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    parser.add_argument("--lengths", default="16,128,512,2048")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    bench.check_arguments(args)  # prompt ids cut to the model's vocabulary, as the bench draws them
    llm = bench.build_llm(args)
    runner = llm.runner
    forward = runner.forward
    timings = []

    def timed_forward(inputs):
        if inputs.is_decode:
            return forward(inputs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        out = forward(inputs)
        host = time.perf_counter() - t
        end.record()
        timings.append((host, start, end))
        return out

    runner.forward = timed_forward
    rng = random.Random(args.seed)
    one = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=1)
    results = {}
    for length in (int(n) for n in args.lengths.split(",")):
        rows = {"wall_ms": [], "forward_host_ms": [], "forward_device_ms": []}
        for i in range(args.repeats + 1):  # the first is a warm-up for this length
            prompt = [rng.randint(0, args.max_token_id) for _ in range(length)]
            timings.clear()
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            if i:
                host, start, end = timings[0]
                rows["wall_ms"].append(wall * 1e3)
                rows["forward_host_ms"].append(host * 1e3)
                rows["forward_device_ms"].append(start.elapsed_time(end))
        results[length] = {k: round(statistics.median(v), 3) for k, v in rows.items()}
        print(f"{length} tokens: {results[length]}", flush=True)
    commit = bench.git_commit(getattr(args, "commit", None))
    print(json.dumps({"gpu": bench.gpu_name(), "commit": commit, "model": args.model,
                      "prefill": results}))
    llm.shutdown()


if __name__ == "__main__":
    main()
