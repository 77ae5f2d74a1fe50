"""GPU time of one decode step at a small batch, without the host: the captured decode graph replayed
back to back, the LM head and the sampler timed with CUDA events. Host jitter moves the batch-1 bench
by +-10% between runs; this does not see it. On one GPU the graph holds the LM head and the sampler
too (engine/cuda_graphs.py), so its time is the whole step's and the two separate timings repeat them.

    PYTHONPATH=. python3 scripts/decode_graph_time.py [--batches 1,8] [--context 768] [--replays 200]
        [--gemv-slice N] [--gemv-min-programs N] [--gemv-eight-warps-above N] [--gemv-set NAME=N,...]
        [--fused-config block_n=32,num_warps=2]
Prints one JSON line: {batch: {"graph_ms", "lm_head_ms", "sample_ms"}} (medians of 5 rounds). The
--gemv options set engine/kernels/gemv.py's slice sizing before the graphs are captured (a sweep), and
--fused-config the fused decode kernel's DecodeConfig fields; the registers and spills of the compiled variants follow.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from engine import bench, graph_edges


def events_ms(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def compiled_kernels(module: str, name: str) -> list[dict]:
    """Registers, spills and warps of each compiled variant of a Triton kernel (empty where this Triton
    keeps its cache elsewhere)."""
    import importlib

    kernel = getattr(importlib.import_module(module), name)
    found = []
    for cache in getattr(kernel, "device_caches", {}).values():
        variants = cache[0] if isinstance(cache, tuple) else cache
        for compiled in getattr(variants, "values", lambda: [])():
            found.append({"regs": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
                          "warps": getattr(getattr(compiled, "metadata", None), "num_warps", None)})
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=768, help="prompt length before the timed steps")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--gemv-slice", type=int, default=None, help="engine.kernels.gemv.MAX_SLICE to try")
    parser.add_argument("--gemv-min-programs", type=int, default=None, help="gemv.MIN_PROGRAMS to try")
    parser.add_argument("--gemv-eight-warps-above", type=int, default=None, help="gemv.EIGHT_WARPS_ABOVE to try")
    parser.add_argument("--gemv-set", default="", metavar="NAME=N,...",
                        help="other engine.kernels.gemv constants to try, e.g. DOT_WIDE_K=2048,DOT_ABOVE_ROWS=4")
    parser.add_argument("--fused-config", default="", metavar="FIELD=N,...",
                        help="DecodeConfig fields for the fused decode kernel to try, e.g. block_n=32,num_warps=2")
    args = parser.parse_args()
    if args.fused_config:  # the fused decode kernel's config, before the graphs capture its launches
        from dataclasses import fields, replace

        from engine.kernels import fused_decode
        names = {f.name for f in fields(fused_decode.DecodeConfig)}
        changes = dict(item.split("=") for item in args.fused_config.split(","))
        if not set(changes) <= names:
            parser.error(f"--fused-config: fields are {sorted(names)}")
        default_config = fused_decode.default_decode_config
        changes = {k: int(v) for k, v in changes.items()}
        fused_decode.default_decode_config = lambda t: replace(default_config(t), **changes)
    from engine.kernels import gemv
    for name in ("slice", "min_programs", "eight_warps_above"):  # before the graphs capture the launches
        value = getattr(args, f"gemv_{name}")
        if value is not None:
            setattr(gemv, "MAX_SLICE" if name == "slice" else name.upper(), value)
    for item in filter(None, args.gemv_set.split(",")):
        name, value = item.split("=")
        if not name.isupper() or not isinstance(getattr(gemv, name, None), int):
            parser.error(f"--gemv-set: {name} is not an integer constant of engine.kernels.gemv")
        setattr(gemv, name, int(value))
    from engine.layers.sampler import SamplingTensors, sample
    from engine.sampling_params import SamplingParams

    llm = bench.build_llm(args)
    runner = llm.runner
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        # prompts of their own for each batch size, so no batch finds another's blocks in the prefix cache
        # (shared first rows made a size's figure depend on the sizes run before it)
        prompts = [[(7 * i + 131 * batch + j) % 10000 for j in range(args.context)] for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=4),
                     use_tqdm=False)  # the graph of this size now holds this batch's last step
        size = next(s for s in runner.graphs.sizes if s >= batch)
        graph, hidden = runner.graphs.graphs[size], runner.graphs.outputs[size][:batch]
        if runner.graphs.samples:
            print(f"batch {batch}: the graph holds the LM head and the sampler (timed again below)", flush=True)
        vocab = runner.model.lm_head.vocab_size
        st = SamplingTensors(temperatures=torch.full((batch,), args.temperature, device="cuda"),
                             top_ks=torch.full((batch,), vocab, device="cuda"),
                             top_ps=torch.ones(batch, device="cuda"), min_ps=torch.zeros(batch, device="cuda"),
                             generators=[None] * batch, all_greedy=False, needs_filter=False)
        seeds = torch.Generator().manual_seed(0)
        logits = runner.model.compute_logits(hidden)
        rounds = {"graph_ms": [], "lm_head_ms": [], "sample_ms": []}
        for _ in range(5):
            rounds["graph_ms"].append(events_ms(graph.replay, args.replays))
            rounds["lm_head_ms"].append(events_ms(lambda: runner.model.compute_logits(hidden), args.replays))
            rounds["sample_ms"].append(events_ms(lambda: sample(logits, st, None, seeds), args.replays))
        results[batch] = {k: round(statistics.median(v), 4) for k, v in rounds.items()}
        print(f"batch {batch}: decode graph {results[batch]['graph_ms']:.4f} ms, LM head "
              f"{results[batch]['lm_head_ms']:.4f} ms, sampling {results[batch]['sample_ms']:.4f} ms", flush=True)
    print(json.dumps({"fused_decode_kernels": compiled_kernels("engine.kernels.fused_decode", "_fused_decode_kernel"),
                      "gemv_kernels": compiled_kernels("engine.kernels.gemv", "_gemv_kernel"),
                      "gemv_dot_kernels": compiled_kernels("engine.kernels.gemv", "_gemv_dot_kernel")}))
    gemv_settings = {"slice": gemv.MAX_SLICE, "min_programs": gemv.MIN_PROGRAMS,
                     "eight_warps_above": gemv.EIGHT_WARPS_ABOVE, "set": args.gemv_set}
    moved = runner.graphs.edges_moved  # REDLINE_GRAPH_EDGES=launch: edges moved per graph, by upstream kernel
    sizes = [next(s for s in runner.graphs.sizes if s >= b) for b in results]
    print(json.dumps({"graph_edges_moved": {s: moved[s] for s in sizes if s in moved}}))
    print(json.dumps({"gpu": bench.gpu_name(), "commit": bench.git_commit(), "model": args.model, "gemv": gemv_settings,
                      "graph_edges": graph_edges.setting(), "steps": results}))
    llm.shutdown()


if __name__ == "__main__":
    main()
