"""GPU check of the Gumbel-max sampling kernel: correctness, then timings against the torch.compile path.

    PYTHONPATH=. python3 scripts/sampling_check.py [--baseline OTHER_SAMPLING_PY]

Checks greedy rows against torch.argmax, layout independence and the token distribution on CUDA,
then times (triton.testing.do_bench, median) gumbel_max (torch.compile) and gumbel_argmax on
[S, 151936] bf16 logits; also the device time alone (CUDA-graph replay) and the host time per call,
since at small S the launch overhead, not the kernel, sets the do_bench figure. --baseline: another
version of engine/kernels/sampling.py (a file), timed beside this one, whose tokens must be the same.
Prints one JSON line last. Imports only engine.layers.sampler, the kernel and tests/sampling_cases.py (no redis,
no pydantic).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from sampling_cases import GPU_LAYOUTS, distribution_case, greedy_case, layout_case, seed_case  # noqa: E402

VOCAB = 151936
BANDWIDTH = 3.0e12  # bytes/s, device read floor used for reference
BATCHES = (1, 16, 64, 128, 256)


def total_variation(counts: list[int], expected: list[float]) -> float:
    n = sum(counts)
    return 0.5 * sum(abs(c / n - p) for c, p in zip(counts, expected))


def check_correctness() -> dict:
    failures = []
    greedy = greedy_case("cuda", VOCAB, GPU_LAYOUTS)
    for layout, tokens in greedy["layouts"].items():
        if any(tokens[i] != greedy["argmax"][i] for i in greedy["greedy_rows"]):
            failures.append(f"greedy rows differ from torch.argmax with layout {layout}")
    layouts = layout_case("cuda", VOCAB, GPU_LAYOUTS, num_rows=64)
    if len({json.dumps(t) for t in layouts.values()}) != 1:
        failures.append(f"tokens depend on the layout: {layouts}")
    seeds = seed_case("cuda", vocab=VOCAB, num_rows=64, layout=(None, None))
    if seeds["first"] != seeds["again"] or seeds["first"] == seeds["other"]:
        failures.append("same seed gave different tokens, or two seeds the same ones")
    dist = distribution_case("cuda", seeds=list(range(20)), rows_per_temperature=5000, num_splits=None, block=None)
    tv = [total_variation(c, p) for c, p in zip(dist["counts"], dist["expected"])]
    if max(tv) > 0.02:  # 100k draws per temperature: sampling error alone stays near 0.005
        failures.append(f"token distribution off softmax(logits / t): total variation {tv}")
    big_tv = large_vocab_distribution()
    if big_tv > 0.02:
        failures.append(f"large-vocab distribution off softmax: total variation {big_tv:.4f}")
    return {"failures": failures, "small_vocab_tv": tv, "large_vocab_tv": big_tv}


def large_vocab_distribution(rows: int = 4096, calls: int = 25) -> float:
    """One bf16 row of VOCAB logits, ten leading tokens and a heavy tail, sampled at t = 0.8:
    total variation between the draws and softmax over {the ten tokens, the rest}."""
    from engine.kernels.sampling import gumbel_argmax

    gen = torch.Generator().manual_seed(9)
    row = torch.randn(VOCAB, generator=gen)
    row[:10] = torch.linspace(8.0, 11.0, 10)
    row = row.to(torch.bfloat16)
    probs = (row.float() / 0.8).softmax(-1)
    expected = probs[:10].tolist() + [probs[10:].sum().item()]
    logits = row.cuda().repeat(rows, 1)
    temperatures = torch.full((rows,), 0.8, device="cuda")
    counts = torch.zeros(11, dtype=torch.int64, device="cuda")
    for seed in range(calls):
        counts += torch.bincount(gumbel_argmax(logits, temperatures, seed).clamp(max=10), minlength=11)
    return total_variation(counts.tolist(), expected)


def host_us(fn, calls: int = 200) -> float:
    """Host time per call, the device left to catch up: what a launch costs the CPU."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def graph_us(fn) -> float | None:
    """Device time alone (replayed from a CUDA graph, no launch overhead); None if capture fails."""
    from triton.testing import do_bench_cudagraph
    try:
        return do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
    except Exception:  # noqa: BLE001 - a figure we can live without
        return None


def load_baseline(path: str):
    """gumbel_argmax of another version of the kernel module, loaded from its file."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("sampling_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gumbel_argmax


def time_both(baseline=None) -> dict:
    from triton.testing import do_bench

    from engine.kernels.sampling import gumbel_argmax
    from engine.layers.sampler import gumbel_max

    timings = {}
    for s in BATCHES:
        logits = torch.randn(s, VOCAB, device="cuda").to(torch.bfloat16)
        temperatures = torch.ones(s, device="cuda")
        fns = {"gumbel_max": lambda: gumbel_max(logits, temperatures),
               "gumbel_argmax": lambda: gumbel_argmax(logits, temperatures, 1234)}
        row = {}
        if baseline is not None:
            fns["baseline"] = lambda: baseline(logits, temperatures, 1234)
            row["same_tokens_as_baseline"] = all(
                torch.equal(gumbel_argmax(logits, temperatures, seed), baseline(logits, temperatures, seed))
                for seed in range(5))
        for name, fn in fns.items():
            fn()  # compile outside the timing
            row[f"{name}_us"] = round(do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3, 1)
            graphed = graph_us(fn)
            row[f"{name}_graph_us"] = None if graphed is None else round(graphed, 1)
            row[f"{name}_host_us"] = round(host_us(fn), 1)
        row["read_floor_us"] = round(s * VOCAB * 2 / BANDWIDTH * 1e6, 2)
        timings[s] = row
    return timings


def main() -> None:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="another sampling.py to time beside this one")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    correctness = check_correctness()
    for failure in correctness["failures"]:
        print("FAIL:", failure)
    timings = time_both(load_baseline(args.baseline) if args.baseline else None)
    if any(not t.get("same_tokens_as_baseline", True) for t in timings.values()):
        correctness["failures"].append("tokens differ from the baseline's")
        print("FAIL: tokens differ from the baseline's")
    print(f"us, bf16 [S, {VOCAB}]; do_bench median, then device alone (CUDA graph), then host per call")
    print(f"{'S':>4} {'gumbel_max':>24} {'gumbel_argmax':>24} {'read floor':>11}")
    for s, t in timings.items():
        old, new = (f"{t[n + '_us']} / {t[n + '_graph_us']} / {t[n + '_host_us']}"
                    for n in ("gumbel_max", "gumbel_argmax"))
        print(f"{s:>4} {old:>24} {new:>24} {t['read_floor_us']:>11}"
              + (f"   baseline {t['baseline_us']} / {t['baseline_graph_us']} / {t['baseline_host_us']}, same tokens "
                 f"{t['same_tokens_as_baseline']}" if "baseline_us" in t else ""))
    print(json.dumps({"device": torch.cuda.get_device_name(), "ok": not correctness["failures"],
                      **{k: v for k, v in correctness.items() if k != "failures"}, "timings_us": timings}))
    sys.exit(1 if correctness["failures"] else 0)


if __name__ == "__main__":
    main()
