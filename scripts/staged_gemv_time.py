"""Does staging one-row GEMV weights in shared memory shorten a batch-1 decode step? (GPU only)

    PYTHONPATH=. python3 scripts/staged_gemv_time.py [--context 768] [--layers 28] [--max-seqlen-k 4096]

Builds the batch-1 chain of the Qwen3-0.6B shape from the engine's kernels (as scripts/decode_chain_trace.py:
qkv GEMV with the norm, fused decode attention, o GEMV, gate_up GEMV with the norm, down GEMV with SiLU·mul,
all with PDL, in one CUDA graph) and prints:
  chain       ms a step for REDLINE_GEMV_STAGED=0, 1 and the MLP's two projections only, with each kernel's
              shared-memory carveout left to the driver and then set to the largest (an SM runs kernels of
              one carveout at a time, so a kernel that needs more shared memory than the SM's current
              configuration waits for it to drain);
  alone       µs a call of each projection, 20 calls back to back in a graph, register against staged GEMV;
  kernels     the profiler's mean µs per kernel in one replay of each chain;
  compiled    registers and shared memory of each compiled variant.
One JSON line at the end.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import statistics

import torch

from engine.kernels import gemv_staged
from engine.kernels.fused_decode import fused_decode
from engine.kernels.gemv import gemv
from engine.kernels.paged_decode import _num_sms, choose_num_splits, default_decode_config

from decode_graph_time import events_ms  # run as a script, this folder is on sys.path
from overlap_check import EPS, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, PAGE, Layer, rotary_tables

CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
KERNELS = [("engine.kernels.gemv", "_gemv_kernel"), ("engine.kernels.gemv_staged", "_staged_gemv_kernel"),
           ("engine.kernels.fused_decode", "_fused_decode_kernel")]


def set_staged(value: str) -> None:
    os.environ["REDLINE_GEMV_STAGED"] = value
    gemv_staged.staged_setting.cache_clear()


def compiled_variants():
    for module, name in KERNELS:
        kernel = getattr(importlib.import_module(module), name, None)
        for cache in getattr(kernel, "device_caches", {}).values():
            variants = cache[0] if isinstance(cache, tuple) else cache
            for k in variants.values():
                yield name, k


def describe() -> list:
    out = []
    for name, k in compiled_variants():
        k._init_handles()
        out.append({"kernel": name, "regs": k.n_regs, "spills": k.n_spills, "shared": k.metadata.shared,
                    "warps": k.metadata.num_warps})
    return out


def set_carveout(percent: int) -> int:
    lib = ctypes.CDLL("libcuda.so.1")
    done = 0
    for _, k in compiled_variants():
        k._init_handles()
        if lib.cuFuncSetAttribute(ctypes.c_void_p(k.function), CARVEOUT, percent) == 0:
            done += 1
    return done


def graph_of(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_means(graph) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return {e.key[:40]: round(e.device_time, 2) for e in prof.key_averages() if e.device_time > 0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--max-seqlen-k", type=int, default=4096)
    parser.add_argument("--skip-chains", action="store_true", help="time the projections alone only")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [Layer(gen) for _ in range(args.layers)]
    pages = -(-args.context // PAGE) + 1
    kv = [(torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen),
           torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen))
          for _ in layers]
    block_tables = torch.arange(pages, dtype=torch.int32, device="cuda")[None, :]
    seqlens = torch.tensor([args.context], dtype=torch.int32, device="cuda")
    positions = (seqlens - 1).long()
    cos, sin = rotary_tables()
    counters = torch.zeros(KV_HEADS, dtype=torch.int32, device="cuda")
    config = default_decode_config(cos)
    splits = choose_num_splits(1, KV_HEADS, args.max_seqlen_k, config.block_n, _num_sms(cos.device),
                               config.grid_programs_per_sm)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step():
        h, r = x, res
        for w, (k_cache, v_cache) in zip(layers, kv):
            qkv, r = gemv(h, w.qkv, norm=(r, w.norm1, EPS))
            att = fused_decode(qkv, positions, cos, sin, w.qk_norm, w.qk_norm, EPS, k_cache, v_cache, positions,
                               seqlens, block_tables, args.max_seqlen_k, HEAD_DIM ** -0.5, HEADS, KV_HEADS, counters,
                               num_splits=splits)
            o = gemv(att.view(1, -1), w.o)
            gate_up, r = gemv(o, w.gate_up, norm=(r, w.norm2, EPS))
            h = gemv(gate_up, w.down, gated=True)
        return h

    settings = {"registers": "0", "staged": "1", "staged_mlp": "6144x1024+1024x3072",
                "staged_qkv_mlp": "4096x1024+6144x1024+1024x3072", "staged_gate_up": "6144x1024"}
    results = {"chain_ms": {}, "alone_us": {}, "kernels_us": {}}
    for slice_elements in (16384, 65536) if not args.skip_chains else ():  # the slices' size (MIN_PROGRAMS still applies)
        gemv_staged.MAX_SLICE = slice_elements
        graphs = {}
        for label in ("registers", "staged", "staged_mlp"):
            set_staged(settings[label])
            graphs[label] = graph_of(step)
        for label, g in graphs.items():
            results["chain_ms"][f"{label}, slice {slice_elements}"] = round(
                statistics.median(events_ms(g.replay, 100) for _ in range(3)), 4)
        del graphs
    gemv_staged.MAX_SLICE = 32768
    w = layers[0]
    a = torch.randn(1, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    g2 = torch.randn(1, 2 * w.down.shape[1], device="cuda", dtype=torch.bfloat16, generator=gen)
    calls = {"qkv": lambda: gemv(x, w.qkv, norm=(res, w.norm1, EPS)), "o": lambda: gemv(a, w.o),
             "gate_up": lambda: gemv(x, w.gate_up, norm=(res, w.norm2, EPS)),
             "down": lambda: gemv(g2, w.down, gated=True)}
    for pdl in ("1", "0"):  # without PDL each call's weight reads start after the call before it ends
        os.environ["REDLINE_PDL"] = pdl
        for name, call in calls.items():
            for label in ("registers", "staged"):
                set_staged(settings[label])
                g = graph_of(lambda: [call() for _ in range(20)])
                results["alone_us"][f"{name} {label}{'' if pdl == '1' else ' no PDL'}"] = round(
                    statistics.median(events_ms(g.replay, 50) for _ in range(3)) * 1e3 / 20, 2)
    os.environ["REDLINE_PDL"] = "1"
    for carveout in (None, 100) if not args.skip_chains else ():
        if carveout is not None:
            results["carveout_set_on"] = set_carveout(carveout)
        graphs = {}
        for label, value in settings.items():
            set_staged(value)
            graphs[label] = graph_of(step)
        times = {label: [] for label in graphs}
        for _ in range(3):  # alternating
            for label, g in graphs.items():
                times[label].append(events_ms(g.replay, 100))
        for label in graphs:
            results["chain_ms"][f"{label}, carveout {carveout or 'driver'}"] = round(statistics.median(times[label]), 4)
        print(results["chain_ms"], flush=True)
        if carveout is None:
            for label in ("registers", "staged"):
                results["kernels_us"][label] = kernel_means(graphs[label])
        del graphs
    results["compiled"] = describe()
    for key in ("alone_us", "kernels_us", "compiled"):
        print(key, json.dumps(results[key]), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
