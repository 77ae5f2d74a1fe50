"""Reproduces docs/performance.md's generation-breadth figures on one engine, each run timed after a warm-up:
  n=4       --num-seqs prompts of nano-bench's lengths, each asking for 4 completions (one prefill, forks
            sharing its KV blocks), against the same prompts sent 4 times as separate requests;
  penalties nano-bench's workload with repetition 1.1, presence 0.5 and frequency 0.5 penalties on every
            request, against the same workload without them.
    python3 bench/breadth.py [--num-seqs 64] [worker.bench_engine's options]      (prints one JSON line)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tree this script is in

from worker import bench_engine as bench  # noqa: E402


def timed(llm, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(c.token_ids) for o in outs for c in o.outputs)


def compare(llm, record: dict, workloads: dict) -> None:
    """Two workloads {name: (prompts, params)} alternating, each run twice, the second timed (the first
    compiles what the warm-up did not); their seconds, tok/s and the first's throughput over the second's."""
    runs = {name: [] for name in workloads}
    for _ in range(2):
        for name, (prompts, params) in workloads.items():
            runs[name].append(timed(llm, prompts, params))
    for name, results in runs.items():
        seconds, tokens = results[-1]
        record[f"{name}_tokens"], record[f"{name}_seconds"] = tokens, round(seconds, 3)
        record[f"{name}_tok_s"] = round(tokens / seconds, 1)
    first, second = workloads
    record[f"{first}_vs_{second}"] = round(record[f"{first}_tok_s"] / record[f"{second}_tok_s"], 4)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.set_defaults(num_seqs=64)
    args = parser.parse_args(argv)
    bench.check_arguments(args)
    prompts, params = bench.make_workload(args)
    llm = bench.build_llm(args)
    bench.warm_up(llm, args)
    record = {"gpu": bench.gpu_name(), "commit": bench.git_commit(args.commit),
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "num_seqs": len(prompts)}

    forked = [dataclasses.replace(p, n=4) for p in params]
    separate = [p for p in params for _ in range(4)]
    repeated = [q for q in prompts for _ in range(4)]
    compare(llm, record, {"n4": (prompts, forked), "separate": (repeated, separate)})
    penalised = [dataclasses.replace(p, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
                 for p in params]
    compare(llm, record, {"penalties": (prompts, penalised), "plain": (prompts, params)})
    print(f"n=4: {record['n4_tok_s']:,.0f} tok/s against 4 separate requests' {record['separate_tok_s']:,.0f} "
          f"({record['n4_vs_separate']:.3f}); penalties: {record['penalties_tok_s']:,.0f} against "
          f"{record['plain_tok_s']:,.0f} tok/s ({record['penalties_vs_plain']:.3f})", file=sys.stderr)
    print(json.dumps(record), flush=True)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
