"""nano-bench's decode attention, step by step: the fused decode kernel on the batches the bench's steps
hold, against the time to read their K/V once.

    PYTHONPATH=. python3 scripts/attention_replay.py [--every 50] [--variants engine,splits2,...]

The profile of a bench run gives the attention's total only (docs/kernels-notes.md). This rebuilds the
workload of engine/bench.py (seed 0, 256 sequences), and for every `--every`-th decode step builds the
step's batch: the sequences still generating, each with its prompt and the tokens so far in a paged cache
laid out as the engine lays it (256-position pages, pages in random order). It times one layer's fused
decode kernel as the engine's decode graph launches it (splits chosen for max_model_len, longest
sequence first, q/k norm) and the variants asked for, each in a CUDA graph, by the profiler's kernel
time, and sets each against the K/V bytes at --read-bw. The whole run's attention is then estimated by
interpolating between the sampled steps, times the layer count: the figure the profile's total is set
against. --layers launches that many layers, each on its own cache as the engine lays them out, in one
graph; each variant's wall time per kernel (`NAME_wall`) is printed beside the profiler's, which counts
twice what PDL lets consecutive kernels overlap. Prints a line per step and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict

import torch
import triton

from engine.kernels import fused_decode as fd
from engine.kernels.paged_decode import DecodeConfig, _num_sms, choose_num_splits, decode_order

from decode_graph_time import events_ms  # run as a script, this folder is on sys.path
from decode_kernel_times import kernel_times
from overlap_check import EPS, HEAD_DIM, HEADS, KV_HEADS, PAGE, captured, rotary_tables

LAYERS = 28


def workload(num_seqs: int = 256) -> tuple[list[int], list[int]]:
    """Prompt lengths and output lengths of engine/bench.py's workload."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num_seqs)]
    outs = [random.randint(100, 1024) for _ in range(num_seqs)]
    return [len(p) for p in prompts], outs


def kernel_us(fn, replays: int = 10) -> tuple[float, float]:
    """(GPU microseconds of fn's kernels by the profiler, wall microseconds) per call, replayed in a CUDA
    graph. With PDL a kernel's programs may start inside the one before and wait there, so the profiler's
    sum over a chain counts that overlap twice; the wall time does not."""
    profiled = sum(kernel_times(fn, replays).values())
    return profiled, events_ms(captured(fn).replay, replays) * 1e3


VARIANTS = {
    # name: (DecodeConfig changes, how the split count is chosen, cache layout)
    "engine": ({}, "engine", "engine"),
    "splits2x": ({}, "double", "engine"),
    "per_sm8": ({"grid_programs_per_sm": 8}, "engine", "engine"),
    "per_sm16": ({"grid_programs_per_sm": 16}, "engine", "engine"),
    "actual_len": ({}, "actual", "engine"),
    "warps8": ({"num_warps": 8}, "engine", "engine"),
    "stages2": ({"num_stages": 2}, "engine", "engine"),
    "stages4": ({"num_stages": 4}, "engine", "engine"),
    "block32": ({"block_n": 32}, "engine", "engine"),
    # splits rounded down, so that the grid is at most one wave of 4 programs an SM (the engine rounds up)
    "floor": ({}, "floor", "engine"),
    # fewer warps a program (one warp keeps the softmax's P in registers for the PV product; four share it
    # through shared memory), more programs an SM to keep as many loads in flight
    "warps1_per_sm16": ({"num_warps": 1, "grid_programs_per_sm": 16}, "engine", "engine"),
    "warps1_per_sm32": ({"num_warps": 1, "grid_programs_per_sm": 32}, "engine", "engine"),
    "warps2_per_sm8": ({"num_warps": 2, "grid_programs_per_sm": 8}, "engine", "engine"),
    # the cache laid out head-major ([page, KV head, position, D], seen through strides as the engine's
    # [page, position, KV head, D]): a KV head's tile is one contiguous run instead of 256 bytes in 2 KB
    "head_major": ({}, "engine", "head_major"),
    "head_major_block128": ({"block_n": 128, "num_stages": 2}, "engine", "head_major"),
    "head_major_stages2": ({"num_stages": 2}, "engine", "head_major"),
}


def split_positions(seqlen: int, split: int, num_splits: int, block_n: int = 64) -> int:
    """Positions in one split of a sequence under the grid schedule (paged_decode.split_range)."""
    per_split = triton.cdiv(triton.cdiv(seqlen, num_splits), block_n) * block_n
    return max(0, min(seqlen, (split + 1) * per_split) - split * per_split)


def trace_summary(trace: torch.Tensor, work_bytes: list[int], sms: int, bins: int = 10) -> dict:
    """How one traced launch's programs fill the GPU: its span (first start to last stamp), the median time a
    program spends before its K/V loop and in it, the programs an SM holds at once (peak, and mean over the
    span), the µs from the first start until the whole grid's concurrency first reaches 90% of its peak and
    from when it last falls below that to the end, and the K/V read rate (each program's bytes spread evenly
    over its loop) in `bins` equal slices of the span, GB/s."""
    t = trace[:, :len(fd.TRACE_POINTS)].double()
    sm = trace[:, -1].tolist()
    start = t[:, 0]
    origin = start.min()
    end = t.max(dim=1).values
    span = (end.max() - origin).item() / 1e3
    stored, attended = t[:, 3], t[:, 4]
    step_ns = 250.0
    n = int((end.max() - origin).item() // step_ns) + 1
    active = torch.zeros(n)
    per_sm = defaultdict(lambda: torch.zeros(n))
    rate = torch.zeros(n)
    for i in range(t.shape[0]):
        a = int((start[i] - origin) // step_ns)
        b = max(a + 1, int((end[i] - origin) // step_ns))
        active[a:b] += 1
        per_sm[sm[i]][a:b] += 1
        la = int((stored[i] - origin) // step_ns)
        lb = max(la + 1, int((attended[i] - origin) // step_ns))
        rate[la:lb] += work_bytes[i] / max(1, lb - la)
    peak = active.max().item()
    full = (active >= 0.9 * peak).nonzero().flatten()
    slices = [round(chunk.sum().item() / (len(chunk) * step_ns), 1) for chunk in rate.tensor_split(bins)]
    return {
        "programs": t.shape[0], "span_us": round(span, 1),
        "before_loop_us": round((stored - start).median().item() / 1e3, 2),
        "to_wait_us": round((t[:, 1] - start).median().item() / 1e3, 2),
        "queries_us": round((t[:, 2] - t[:, 1]).median().item() / 1e3, 2),
        "store_us": round((stored - t[:, 2]).median().item() / 1e3, 2),
        "loop_us": round((attended - stored).median().item() / 1e3, 2),
        "after_loop_us": round((end - attended).median().item() / 1e3, 2),
        "per_sm_peak": max(v.max().item() for v in per_sm.values()),
        "per_sm_mean": round(active.mean().item() / sms, 2),
        "ramp_us": round(full[0].item() * step_ns / 1e3, 1) if len(full) else None,
        "tail_us": round((n - 1 - full[-1].item()) * step_ns / 1e3, 1) if len(full) else None,
        "read_gb_s_by_slice": slices,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--variants", default="engine,splits2x,per_sm8,actual_len,warps8,stages4")
    parser.add_argument("--read-bw", type=float, default=3.07e12)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=1,
                        help="layers, each with its own cache, launched one after another in the graph (as the engine)")
    parser.add_argument("--blocks", type=int, default=0,
                        help="pages in each layer's cache (0: the workload's); the engine sizes it from free memory")
    parser.add_argument("--scatter", action="store_true",
                        help="the workload's pages drawn from all --blocks pages, not the first ones")
    parser.add_argument("--steps", default="", help="steps to sample, comma-separated (default: every --every)")
    parser.add_argument("--trace", action="store_true",
                        help="also launch each variant's kernel once with trace= at each sampled step and print how "
                             "its programs fill the SMs over time (trace_summary)")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ins, outs = workload()
    pages_of = [triton.cdiv(i + o, PAGE) for i, o in zip(ins, outs)]
    blocks = max(args.blocks, sum(pages_of))
    perm = torch.randperm(blocks if args.scatter else sum(pages_of)).tolist()
    tables, at = [], 0
    for n in pages_of:
        tables.append(perm[at:at + n])
        at += n
    width = max(pages_of)
    # the engine's layout: [K/V, layer, page, position, KV head, D]
    caches = {}
    for layout in {VARIANTS[n][2] for n in names}:
        if layout == "engine":
            cache = torch.empty(2, args.layers, blocks, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        else:
            cache = torch.empty(2, args.layers, blocks, KV_HEADS, PAGE, HEAD_DIM, device=dev,
                                dtype=torch.bfloat16).transpose(3, 4)
        for layer in range(args.layers):
            cache[:, layer].normal_()
        caches[layout] = cache
    cos, sin = rotary_tables(args.max_model_len)
    q_w = torch.ones(HEAD_DIM, device=dev, dtype=torch.bfloat16)
    k_w = torch.ones_like(q_w)
    kv_bytes = KV_HEADS * HEAD_DIM * 2 * 2  # one position of one layer, K and V
    sms = _num_sms(dev)
    steps = ([int(v) for v in args.steps.split(",")] if args.steps
             else list(range(0, max(outs), args.every)) + [max(outs) - 1])
    rows, per_variant = [], defaultdict(dict)
    for s in steps:
        live = [i for i, o in enumerate(outs) if o > s]
        lens = [ins[i] + s + 1 for i in live]
        B = len(live)
        seqlens = torch.tensor(lens, device=dev, dtype=torch.int32)
        bt = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in live], device=dev, dtype=torch.int32)
        slots = torch.tensor([tables[i][(n - 1) // PAGE] * PAGE + (n - 1) % PAGE for i, n in zip(live, lens)],
                             device=dev, dtype=torch.int64)
        positions = (seqlens - 1).to(torch.int64)
        qkv = torch.randn(B, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=torch.bfloat16)
        counters = torch.zeros(B * KV_HEADS, device=dev, dtype=torch.int32)
        order = decode_order(seqlens)
        floor_us = sum(lens) * kv_bytes / args.read_bw * 1e6
        row = {"step": s, "rows": B, "kv_mb": round(sum(lens) * kv_bytes / 1e6, 1), "floor_us": round(floor_us, 1)}
        for name in names:
            changes, split_rule, layout = VARIANTS[name]
            cache = caches[layout]
            config = DecodeConfig(**changes)
            max_len = max(lens) if split_rule == "actual" else args.max_model_len
            splits = choose_num_splits(B, KV_HEADS, max_len, config.block_n, sms, config.grid_programs_per_sm)
            if split_rule == "double":
                splits = min(64, max(2, 2 * splits))
            if split_rule == "floor":
                splits = max(1, min(splits, config.grid_programs_per_sm * sms // (B * KV_HEADS)))
            def launch(layer: int, trace: torch.Tensor | None = None) -> None:
                fd.fused_decode(qkv, positions, cos, sin, q_w, k_w, EPS, cache[0, layer], cache[1, layer], slots,
                                seqlens, bt, max_len, HEAD_DIM ** -0.5, HEADS, KV_HEADS, counters, order=order,
                                num_splits=splits, config=config, trace=trace, after_gemv=False)

            def step():
                for layer in range(args.layers):
                    launch(layer)
            kernel, wall = kernel_us(step)
            us = kernel / args.layers
            row[name] = round(us, 1)
            row[f"{name}_wall"] = round(wall / args.layers, 1)
            row[f"{name}_splits"] = splits
            per_variant[name][s] = us
            if args.trace:
                trace = torch.zeros(KV_HEADS * B * splits, fd.TRACE_WIDTH, device=dev, dtype=torch.int64)
                for _ in range(2):  # the first compiles the traced kernel; the second is the one read
                    launch(0, trace)
                torch.cuda.synchronize()
                # programs in grid order (KV head fastest, then the ordered sequence, then the split)
                seq_of = order.cpu().tolist()
                work = [split_positions(lens[seq_of[j]], sp, splits, config.block_n) * kv_bytes // KV_HEADS
                        for sp in range(splits) for j in range(B) for _ in range(KV_HEADS)]
                row[f"{name}_trace"] = trace_summary(trace.cpu(), work, sms)
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    # the whole run: every decode step, interpolated between the sampled ones, times the layers
    all_steps = range(max(outs))
    floor_total = sum(sum(ins[i] + s + 1 for i, o in enumerate(outs) if o > s) for s in all_steps) * kv_bytes
    estimate = {}
    for name, by_step in per_variant.items():
        xs = sorted(by_step)
        total = 0.0
        for s in all_steps:
            j = max(k for k in range(len(xs)) if xs[k] <= s)
            if j + 1 < len(xs):
                a, b = xs[j], xs[j + 1]
                total += by_step[a] + (by_step[b] - by_step[a]) * (s - a) / (b - a)
            else:
                total += by_step[xs[j]]
        estimate[name] = round(total * LAYERS / 1e6, 3)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "read_bw": args.read_bw, "layers": args.layers,
                      "blocks": blocks,
                      "floor_s": round(floor_total * LAYERS / args.read_bw, 3), "run_attention_s": estimate,
                      "steps": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
