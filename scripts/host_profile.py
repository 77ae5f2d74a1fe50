"""Where the host's time goes in a bench run: the wall time split into host work and waiting for the
device's tokens, then a cProfile table of the host work.

    PYTHONPATH=. python3 scripts/host_profile.py --num-seqs 1 --min-input-len 512 --max-input-len 512 \
        --min-output-len 512 --max-output-len 512 [--top 40]

Takes `redline bench`'s options. Runs the workload twice after the bench's warm-up: once timed, with the
seconds spent waiting in SampledTokens.result() counted (the rest of the wall time is the host's own
work, which the device does not hide when the wait is near zero), and once under cProfile (slower; its
table ranks the host's functions).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

from engine import bench
from engine import model_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--top", type=int, default=40, help="rows of the cProfile table")
    args = parser.parse_args()
    prompts, params = bench.make_workload(args)
    llm = bench.build_llm(args)
    bench.warm_up(llm, args)

    waited = [0.0, 0]
    result = model_runner.SampledTokens.result

    def timed_result(self):
        start = time.perf_counter()
        out = result(self)
        waited[0] += time.perf_counter() - start
        waited[1] += 1
        return out

    model_runner.SampledTokens.result = timed_result
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    model_runner.SampledTokens.result = result
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = waited[1]
    record = {"tokens": tokens, "seconds": round(wall, 4), "steps": steps,
              "ms_per_step": round(1e3 * wall / max(steps, 1), 4),
              "wait_ms_per_step": round(1e3 * waited[0] / max(steps, 1), 4),
              "host_ms_per_step": round(1e3 * (wall - waited[0]) / max(steps, 1), 4)}
    print(json.dumps(record), flush=True)

    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())
    shutdown = getattr(llm, "shutdown", None)
    if shutdown:
        shutdown()


if __name__ == "__main__":
    main()
