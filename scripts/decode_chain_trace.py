"""Where a batch-1 decode layer's time goes inside its attention kernel (GPU only).

    PYTHONPATH=. python3 scripts/decode_chain_trace.py [--context 768] [--layers 28] [--max-seqlen-k 4096,768]

Builds the chain a batch-1 decode graph runs for the Qwen3-0.6B shape from the engine's kernels: per layer
the qkv GEMV (input norm fused), the fused decode attention, the o GEMV, the gate_up GEMV (norm fused) and
the down GEMV (SiLU·mul fused), all launched with PDL, captured in one CUDA graph. The fused decode kernel
runs with trace= (engine/kernels/fused_decode.py): each program writes the global timer when it starts,
when its wait for the qkv GEMV returns, when its queries are ready, when the new token's K/V are stored,
when its range is attended, when it has its ticket, and (the last program of a KV head) when the merge
is done. Per layer, times are taken from the first "waited" (the qkv GEMV complete), and the medians over
the layers are printed: when programs start and pass each point (first, median and last program), when
the kernel's last program is done, and how long the four GEMVs take from there to the next layer's
"waited". --max-seqlen-k sets what the split count is chosen from (the engine's graphs use
max_model_len, 4096 in the bench). Prints a table for each and one JSON line.

The GEMVs run with trace= too (engine/kernels/gemv.py: start, wait returned, last store), and a second
table gives, per projection, when its first / median / last program passes each point, in µs after the
fused decode kernel's first "waited" of the same layer. --sweep then captures one graph per projection
and (rows a program holds, warps) in place of the GEMV's defaults, the other projections on theirs,
and prints each graph's ms a step beside the defaults' (measured alternately); --trace-sweep does the same
for graphs with only some kernels traced (the stamps move the schedule they measure).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from engine.kernels.fused_decode import TRACE_POINTS, TRACE_WIDTH, fused_decode
from engine.kernels import gemv as gemv_module
from engine.kernels.gemv import gemv, slice_rows
from engine.kernels.paged_decode import _num_sms, choose_num_splits, default_decode_config

from decode_graph_time import events_ms  # run as a script, this folder is on sys.path
from overlap_check import EPS, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, PAGE, Layer, rotary_tables

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def against_default(default: torch.cuda.CUDAGraph, variant: torch.cuda.CUDAGraph, label: dict) -> dict:
    """label with the ms a step of the variant and of the default graph, replayed alternately (medians)."""
    ms = [events_ms(g.replay, 100) for _ in range(3) for g in (default, variant)]
    return {**label, "default_ms": round(statistics.median(ms[0::2]), 4), "ms": round(statistics.median(ms[1::2]), 4)}


def gemv_table(gemv_traces: dict, origin: torch.Tensor) -> dict:
    """Per projection: its programs and, per TRACE_POINT, the first / median / last program's µs after the
    layer's origin (medians over the layers after the first)."""
    table = {}
    for name, t in gemv_traces.items():
        g = t.cpu()[:, :, :len(gemv_module.TRACE_POINTS)].double() / 1e3
        table[name] = {"programs": g.shape[1]}
        for j, point in enumerate(gemv_module.TRACE_POINTS):
            per_layer = [(g[i, :, j] - origin[i]).sort().values for i in range(1, g.shape[0])]
            table[name][point] = [round(statistics.median(v[q].item() for v in per_layer), 2)
                                  for q in (0, g.shape[1] // 2, -1)]
    return table


def run(args, max_seqlen_k: int, gen: torch.Generator) -> dict:
    layers = [Layer(gen) for _ in range(args.layers)]
    pages = -(-args.context // PAGE) + 1
    kv = [(torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen),
           torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen))
          for _ in layers]
    block_tables = torch.arange(pages, dtype=torch.int32, device="cuda")[None, :]
    seqlens = torch.tensor([args.context], dtype=torch.int32, device="cuda")
    positions = (seqlens - 1).long()
    slots = positions.clone()  # block 0 first: position p is slot p
    cos, sin = rotary_tables()
    counters = torch.zeros(KV_HEADS, dtype=torch.int32, device="cuda")
    config = default_decode_config(cos)
    splits = choose_num_splits(1, KV_HEADS, max_seqlen_k, config.block_n, _num_sms(cos.device),
                               config.grid_programs_per_sm)
    programs = KV_HEADS * splits
    traces = torch.zeros(args.layers, programs, TRACE_WIDTH, dtype=torch.int64, device="cuda")
    gemv_traces = {name: torch.zeros(args.layers, -(-getattr(layers[0], name).shape[0] // slice_rows(
        *getattr(layers[0], name).shape)), gemv_module.TRACE_WIDTH, dtype=torch.int64, device="cuda")
        for name in PROJECTIONS}
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step(trace, configs: dict):
        """trace: True, False or the set of kernels ("decode" and projections) to trace."""
        traced = (set(PROJECTIONS) | {"decode"}) if trace is True else (trace or set())

        def proj(name, i, h, w, **kw):
            block_n, num_warps = configs.get(name, (None, None))
            return gemv(h, getattr(w, name), block_n=block_n, num_warps=num_warps,
                        trace=gemv_traces[name][i] if name in traced else None, **kw)
        h, r = x, res
        for i, (w, (k_cache, v_cache)) in enumerate(zip(layers, kv)):
            qkv, r = proj("qkv", i, h, w, norm=(r, w.norm1, EPS))
            att = fused_decode(qkv, positions, cos, sin, w.qk_norm, w.qk_norm, EPS, k_cache, v_cache, slots,
                               seqlens, block_tables, max_seqlen_k, HEAD_DIM ** -0.5, HEADS, KV_HEADS, counters,
                               num_splits=splits, trace=traces[i] if "decode" in traced else None)
            o = proj("o", i, att.view(1, -1), w)
            gate_up, r = proj("gate_up", i, o, w, norm=(r, w.norm2, EPS))
            h = proj("down", i, gate_up, w, gated=True)
        return h

    def capture(trace, configs: dict) -> torch.cuda.CUDAGraph:
        step(trace, configs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(trace, configs)
        return graph

    graphs = {trace: capture(trace, {}) for trace in (False, True)}
    step_ms = {str(t): statistics.median(events_ms(g.replay, 100) for _ in range(5)) for t, g in graphs.items()}
    variants = []
    if args.trace_sweep:  # how much tracing each kernel moves the step's time
        variants += [({"variant": label}, traced, {}) for label, traced in
                     [("decode", {"decode"}), ("gemvs", set(PROJECTIONS))] + [(n, {n}) for n in PROJECTIONS]]
    if args.sweep:
        for name in PROJECTIONS:
            n, k = getattr(layers[0], name).shape
            default = slice_rows(n, k)
            variants += [({"projection": name, "block_n": block_n, "num_warps": num_warps,
                           "programs": -(-n // block_n)}, set(), {name: (block_n, num_warps)})
                         for block_n in (default // 2, default, default * 2) for num_warps in (4, 8)]
    sweep = [against_default(graphs[False], capture(traced, configs), label) for label, traced, configs in variants]
    traces.zero_()  # the merging program can differ between replays
    for t in gemv_traces.values():
        t.zero_()
    graphs[True].replay()
    torch.cuda.synchronize()
    t = traces.cpu()
    stamps = t[:, :, : len(TRACE_POINTS)].double() / 1e3  # µs
    sms = t[:, :, -1]
    rows = {}
    origin = stamps[:, :, 1].min(dim=1).values  # per layer: the first program past its wait
    for j, point in enumerate(TRACE_POINTS):
        col = stamps[:, :, j]
        written = col > 0
        per_layer = []
        for i in range(1, args.layers):  # layer 0 follows the graph's start, not a layer
            vals = (col[i][written[i]] - origin[i]).sort().values
            if len(vals):
                per_layer.append((vals[0].item(), vals[len(vals) // 2].item(), vals[-1].item(), len(vals)))
        rows[point] = [round(statistics.median(v[k] for v in per_layer), 2) for k in range(3)] + [per_layer[0][3]]
    end = torch.where(stamps > 0, stamps, torch.zeros_like(stamps)).amax(dim=(1, 2))  # each layer's last stamp
    gemvs = [(origin[i + 1] - end[i]).item() for i in range(1, args.layers - 1)]
    previous_end = [(stamps[i, :, 0].min() - end[i - 1]).item() for i in range(1, args.layers)]
    return {"max_seqlen_k": max_seqlen_k, "splits": splits, "programs": programs,
            "gemvs": gemv_table(gemv_traces, origin),
            "sweep": sweep,
            "step_ms": step_ms,
            "points_us_first_median_last_count": rows,
            "kernel_span_us": round(statistics.median((end[i] - origin[i]).item() for i in range(1, args.layers)), 2),
            "first_start_after_previous_decode_end_us": round(statistics.median(previous_end), 2),
            "gemvs_to_next_wait_us": round(statistics.median(gemvs), 2),
            "distinct_sms": int(statistics.median(len(set(sms[i].tolist())) for i in range(args.layers)))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--max-seqlen-k", default="4096,768")
    parser.add_argument("--sweep", action="store_true", help="time other (rows, warps) per projection")
    parser.add_argument("--trace-sweep", action="store_true", help="time the graph with each kernel traced")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for value in args.max_seqlen_k.split(","):
        r = run(args, int(value), gen)
        results.append(r)
        print(f"\nmax_seqlen_k {r['max_seqlen_k']}: {r['splits']} splits, "
              f"{r['programs']} programs on "
              f"{r['distinct_sms']} SMs; graph {r['step_ms']['False']:.4f} ms a step "
              f"({r['step_ms']['True']:.4f} traced)")
        print("point      first  median   last  (µs after the first program's wait returned; median of layers)")
        for point, (first, median, last, count) in r["points_us_first_median_last_count"].items():
            print(f"{point:9s} {first:6.2f} {median:7.2f} {last:6.2f}  ({count} programs)")
        print(f"kernel span (first waited -> last stamp) {r['kernel_span_us']} µs; first start after the previous "
              f"layer's last stamp {r['first_start_after_previous_decode_end_us']} µs; four GEMVs to the next "
              f"layer's wait {r['gemvs_to_next_wait_us']} µs", flush=True)
        print("GEMV     programs  start f/m/l          waited f/m/l         done f/m/l   (µs, same origin)")
        for name, row in r["gemvs"].items():
            cells = "  ".join("/".join(f"{v:.2f}" for v in row[p]) for p in gemv_module.TRACE_POINTS)
            print(f"{name:8s} {row['programs']:8d}  {cells}")
        for v in r["sweep"]:
            if "projection" in v:
                print(f"sweep {v['projection']:8s} rows {v['block_n']:3d} warps {v['num_warps']} ({v['programs']} "
                      f"programs): {v['ms']:.4f} ms against {v['default_ms']:.4f} default", flush=True)
            else:
                print(f"traced {v['variant']:8s}: {v['ms']:.4f} ms against {v['default_ms']:.4f} untraced", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
