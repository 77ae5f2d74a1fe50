"""Would two half batches on two streams hide a decode step's GEMMs under its attention? (GPU only)

    PYTHONPATH=. python3 scripts/overlap_check.py [--batches 256,128] [--layers 28] [--min-context 500]
        [--max-context 1500]

Builds the Qwen3-0.6B decode layer from the engine's kernels (RMSNorm, cuBLAS projections, fused decode
attention, SiLU·mul) over a paged KV cache of random sequences, and times CUDA graphs of one step:
  whole      the batch through every layer, one stream (what the engine runs);
  halves     two half batches one after the other in each layer, one stream (the cost of splitting);
  pingpong   each half on its own stream; the halves' attention kernels take turns (B's attention of a
             layer waits for A's, A's next waits for B's), so one half's projections run beside the
             other half's attention;
  priority   pingpong with each half's attention on a low-priority stream of its own;
and pingpong and whole again with the attention's grid at 2 programs an SM (room for the projections'
blocks) and with the projections through engine/kernels/skinny_gemm.py (less shared memory a block).
  green<N>   pingpong with both halves' attention on a stream of a CUDA green context of N SMs, so the
             other SMs stay free for the projections (on ordinary streams); --green lists the Ns;
             attention_green<N> is the attention alone there; *_eager the same launched without a graph.
  rest_half_green<M>  a half batch's projections alone on a green context of M SMs (the SMs a pingpong
             leaves them when the attention has the rest).
--trace DIR profiles one replay of the first batch's pingpong graphs (plain and green) and prints how much
of the projections' kernel time runs beside an attention kernel, and the kernels of two middle layers.
Prints a table and one JSON line of ms per step (median of 5 rounds of 20 replays).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.kernels.fused_decode import default_decode_config, fused_decode
from engine.kernels.norm_act import rms_norm, silu_and_mul
from engine.kernels.skinny_gemm import skinny_linear

from decode_graph_time import events_ms  # run as a script, this folder is on sys.path
from trace_summary import gpu_events

LINEAR = {"linear": F.linear}  # what the projections run: cuBLAS, or the skinny Triton GEMM
ATTENTION = {"programs_per_sm": None}  # the fused decode's grid_programs_per_sm (None: its default)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 8, 128, 3072
PAGE = 256
EPS = 1e-6


class Layer:
    def __init__(self, gen: torch.Generator):
        def w(*shape):
            return (torch.randn(*shape, generator=gen, device="cuda") * shape[-1] ** -0.5).to(torch.bfloat16)
        self.norm1 = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.norm2 = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.qk_norm = torch.ones(HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.qkv = w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
        self.o = w(HIDDEN, HEADS * HEAD_DIM)
        self.gate_up = w(2 * INTER, HIDDEN)
        self.down = w(HIDDEN, INTER)


def rotary_tables(positions: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, HEAD_DIM / 2] of Qwen3's rotary embedding (theta 1e6), on the GPU."""
    inv = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    return freqs.cos().cuda(), freqs.sin().cuda()


class Batch:
    """One decode batch: contexts, block tables, slots, its own split counters."""

    def __init__(self, lengths: list[int], first_block: int, device="cuda"):
        self.n = len(lengths)
        blocks = [-(-n // PAGE) for n in lengths]
        width = max(blocks)
        table = torch.zeros(self.n, width, dtype=torch.int32)
        nxt = first_block
        for i, b in enumerate(blocks):
            table[i, :b] = torch.arange(nxt, nxt + b)
            nxt += b
        self.blocks_used = nxt - first_block
        self.block_tables = table.to(device)
        self.seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        pos = torch.tensor(lengths, dtype=torch.int64) - 1
        slots = table[torch.arange(self.n), pos // PAGE].long() * PAGE + pos % PAGE
        self.positions = pos.to(device)
        self.slots = slots.to(device)
        self.max_len = max(lengths)
        self.counters = torch.zeros(self.n * KV_HEADS + 1024, dtype=torch.int32, device=device)
        self.order = torch.argsort(self.seqlens, descending=True, stable=True).to(torch.int32)


def pre(layer, x, res):
    h, res = rms_norm(x, layer.norm1, EPS, residual=res)
    return LINEAR["linear"](h, layer.qkv), res


def attend(layer, qkv, b: Batch, caches, cos, sin):
    k_cache, v_cache = caches
    config = default_decode_config(qkv)
    if ATTENTION["programs_per_sm"]:
        config = replace(config, grid_programs_per_sm=ATTENTION["programs_per_sm"])
    return fused_decode(qkv, b.positions, cos, sin, layer.qk_norm, layer.qk_norm, EPS, k_cache, v_cache, b.slots,
                        b.seqlens, b.block_tables, b.max_len, HEAD_DIM ** -0.5, HEADS, KV_HEADS, b.counters,
                        order=b.order, config=config)


def post(layer, att, res):
    linear = LINEAR["linear"]
    o = linear(att.view(att.shape[0], -1), layer.o)
    h, res = rms_norm(o, layer.norm2, EPS, residual=res)
    return linear(silu_and_mul(linear(h, layer.gate_up)), layer.down), res


def step_whole(layers, kv, x, res, b, cos, sin):
    for layer, caches in zip(layers, kv):
        qkv, res = pre(layer, x, res)
        x, res = post(layer, attend(layer, qkv, b, caches, cos, sin), res)
    return x, res


def step_halves(layers, kv, xs, ress, bs, cos, sin):
    xs, ress = list(xs), list(ress)
    for layer, caches in zip(layers, kv):
        for i in range(2):
            qkv, ress[i] = pre(layer, xs[i], ress[i])
            xs[i], ress[i] = post(layer, attend(layer, qkv, bs[i], caches, cos, sin), ress[i])
    return xs, ress


def step_pingpong(layers, kv, xs, ress, bs, cos, sin, streams, attn_streams):
    """streams[i]: half i's projections; attn_streams[i]: its attention (may be streams[i])."""
    main = torch.cuda.current_stream()
    for s in set(streams) | set(attn_streams):
        s.wait_stream(main)
    xs, ress = list(xs), list(ress)
    last_attn_done = None
    for layer, caches in zip(layers, kv):
        for i in range(2):
            with torch.cuda.stream(streams[i]):
                qkv, ress[i] = pre(layer, xs[i], ress[i])
            ready = torch.cuda.Event()
            ready.record(streams[i])
            a = attn_streams[i]
            a.wait_event(ready)
            if last_attn_done is not None:
                a.wait_event(last_attn_done)  # the halves' attention kernels take turns
            with torch.cuda.stream(a):
                att = attend(layer, qkv, bs[i], caches, cos, sin)
            last_attn_done = torch.cuda.Event()
            last_attn_done.record(a)
            streams[i].wait_event(last_attn_done)
            with torch.cuda.stream(streams[i]):
                xs[i], ress[i] = post(layer, att, ress[i])
    for s in set(streams) | set(attn_streams):
        main.wait_stream(s)
    return xs, ress


def green_stream(num_sms: int, workqueue_scope: str | None = None):
    """(context, stream): a stream whose kernels run on num_sms SMs only (keep the context alive)."""
    from torch.cuda import green_contexts

    kwargs = {"workqueue_scope": workqueue_scope} if workqueue_scope else {}
    ctx = green_contexts.GreenContext.create(num_sms=num_sms, **kwargs)
    if hasattr(ctx, "Stream"):
        return ctx, ctx.Stream()
    ctx.set_context()  # older API: the context's stream becomes the current stream
    stream = torch.cuda.current_stream()
    ctx.pop_context()
    return ctx, stream


def on_stream(stream, fn):
    """fn's kernels on stream, ordered after and before the current stream's work."""
    main = torch.cuda.current_stream()
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        out = fn()
    main.wait_stream(stream)
    return out


def attempt(timer, fn):
    """timer(fn), or None (the error printed) where the variant cannot run here."""
    try:
        return timer(fn)
    except Exception as exc:  # a driver without green contexts, a capture that refuses their streams
        print(f"variant failed: {type(exc).__name__}: {exc}", flush=True)
        return None


def eager_ms(fn) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    return statistics.median(events_ms(fn, 5) for _ in range(5))


def captured(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (warmed up on a side stream first) and replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_ms(fn) -> float:
    graph = captured(fn)
    rounds = [events_ms(graph.replay, 20) for _ in range(5)]
    del graph
    return statistics.median(rounds)


def union_us(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals merged where they overlap, in order."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def intersection_us(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Time covered by both of two lists of disjoint intervals."""
    total = 0.0
    for a, b in xs:
        for c, d in ys:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def trace_replay(fn, path: str, label: str, layers: int) -> dict:
    """Profile one replay of fn's graph; how much projection time runs beside attention, and two layers."""
    from torch.profiler import ProfilerActivity, profile

    graph = captured(fn)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    os.makedirs(path, exist_ok=True)
    out = os.path.join(path, f"{label}.json")
    prof.export_chrome_trace(out)
    events = [e for e in gpu_events(out) if e["cat"] == "kernel"]
    t0 = events[0]["ts"]
    attn = [(e["ts"] - t0, e["ts"] - t0 + e["dur"]) for e in events if "fused_decode" in e["name"]]
    rest = [(e["ts"] - t0, e["ts"] - t0 + e["dur"]) for e in events if "fused_decode" not in e["name"]]
    attn_u, rest_u = union_us(attn), union_us(rest)
    span = events[-1]["ts"] + events[-1]["dur"] - t0
    summary = {"span_us": round(span, 1), "attention_busy_us": round(sum(b - a for a, b in attn_u), 1),
               "rest_busy_us": round(sum(b - a for a, b in rest_u), 1),
               "rest_beside_attention_us": round(intersection_us(rest_u, attn_u), 1),
               "kernels": len(events)}
    print(label, summary, flush=True)
    per_layer = len(events) // layers
    mid = layers // 2 * per_layer
    for e in events[mid:mid + 2 * per_layer]:
        print(f"  {label} stream {e['args'].get('stream')} {e['ts'] - t0:10.1f} +{e['dur']:7.1f}  {e['name'][:60]}")
    del graph
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="256,128")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--min-context", type=int, default=500)
    parser.add_argument("--max-context", type=int, default=1500)
    parser.add_argument("--green", default="", help="SM counts of the attention's green context, e.g. 112,120")
    parser.add_argument("--only-green", action="store_true", help="skip the variants that take no green context")
    parser.add_argument("--workqueue-scope", default=None, help="the green contexts' workqueue_scope, e.g. balanced")
    parser.add_argument("--trace", default="", metavar="DIR", help="profile the first batch's pingpong replays")
    args = parser.parse_args()
    greens = [int(v) for v in args.green.split(",") if v]
    contexts = {n: green_stream(n, args.workqueue_scope) for n in greens}
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    rest_contexts = {sm_count - n: green_stream(sm_count - n, args.workqueue_scope) for n in greens}
    for n, (ctx, _) in contexts.items():
        print(f"green context of {n} SMs: {ctx!r}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    layers = [Layer(gen) for _ in range(args.layers)]
    cos, sin = rotary_tables()
    results = {}
    for batch in (int(v) for v in args.batches.split(",")):
        lengths = torch.randint(args.min_context, args.max_context + 1, (batch,), generator=cpu_gen).tolist()
        whole = Batch(lengths, 0)
        half = batch // 2
        bs = [Batch(lengths[:half], 0), None]
        bs[1] = Batch(lengths[half:], bs[0].blocks_used)
        num_blocks = whole.blocks_used
        kv = [(torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen),
               torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen))
              for _ in layers]
        x = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        res = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        xs, ress = [x[:half], x[half:]], [res[:half], res[half:]]
        kv_bytes = sum(lengths) * 2 * KV_HEADS * HEAD_DIM * 2 * len(layers)
        row = {"kv_floor_ms": kv_bytes / 3.0e12 * 1e3}
        row["whole"] = graph_ms(lambda: step_whole(layers, kv, x, res, whole, cos, sin))
        qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)

        def attention_only():
            return [attend(l, qkv, whole, c, cos, sin) for l, c in zip(layers, kv)]
        s = [torch.cuda.Stream(), torch.cuda.Stream()]
        for n, (_, green) in contexts.items():
            greens2 = [green, green]
            row[f"attention_green{n}"] = attempt(graph_ms, lambda: on_stream(green, attention_only))
            row[f"green{n}"] = attempt(graph_ms, lambda: step_pingpong(layers, kv, xs, ress, bs, cos, sin, s, greens2))
            row[f"green{n}_eager"] = attempt(eager_ms,
                                             lambda: step_pingpong(layers, kv, xs, ress, bs, cos, sin, s, greens2))
        att_half = torch.randn(half, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        for m, (_, green) in rest_contexts.items():
            row[f"rest_half_green{m}"] = attempt(graph_ms, lambda: on_stream(
                green, lambda: [(pre(l, xs[0], ress[0]), post(l, att_half, ress[0])) for l in layers]))
        row["rest_half"] = graph_ms(lambda: [(pre(l, xs[0], ress[0]), post(l, att_half, ress[0])) for l in layers])
        if args.trace and not results:
            trace_replay(lambda: step_pingpong(layers, kv, xs, ress, bs, cos, sin, s, s), args.trace,
                         f"pingpong{batch}", len(layers))
            for n, (_, green) in contexts.items():
                attempt(lambda fn: trace_replay(fn, args.trace, f"green{n}_{batch}", len(layers)),
                        lambda: step_pingpong(layers, kv, xs, ress, bs, cos, sin, s, [green, green]))
        if contexts:
            row["attention_only"] = graph_ms(attention_only)
            row["whole_eager"] = eager_ms(lambda: step_whole(layers, kv, x, res, whole, cos, sin))
            row["pingpong_eager"] = eager_ms(lambda: step_pingpong(layers, kv, xs, ress, bs, cos, sin, s, s))
        if args.only_green:
            results[batch] = {k: v if v is None else round(v, 3) for k, v in row.items()}
            print(batch, results[batch], flush=True)
            continue
        row["halves"] = graph_ms(lambda: step_halves(layers, kv, xs, ress, bs, cos, sin))
        row["pingpong"] = graph_ms(lambda: step_pingpong(layers, kv, xs, ress, bs, cos, sin, s, s))
        low, high = torch.cuda.Stream.priority_range()
        hi = [torch.cuda.Stream(priority=high), torch.cuda.Stream(priority=high)]
        lo = [torch.cuda.Stream(priority=low), torch.cuda.Stream(priority=low)]
        row["priority"] = graph_ms(lambda: step_pingpong(layers, kv, xs, ress, bs, cos, sin, hi, lo))
        # attention leaving room on the SMs (fewer programs), and projections with a smaller footprint
        ATTENTION["programs_per_sm"] = 2
        row["pingpong_attention_2_per_sm"] = graph_ms(lambda: step_pingpong(layers, kv, xs, ress, bs, cos, sin, s, s))
        row["whole_attention_2_per_sm"] = graph_ms(lambda: step_whole(layers, kv, x, res, whole, cos, sin))
        ATTENTION["programs_per_sm"] = None
        LINEAR["linear"] = skinny_linear
        row["pingpong_triton_gemm"] = graph_ms(lambda: step_pingpong(layers, kv, xs, ress, bs, cos, sin, s, s))
        row["whole_triton_gemm"] = graph_ms(lambda: step_whole(layers, kv, x, res, whole, cos, sin))
        LINEAR["linear"] = F.linear
        # the attention alone and the rest alone, for the sum
        row["attention_only"] = graph_ms(attention_only)
        att = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        row["rest_only"] = graph_ms(lambda: [(pre(l, x, res), post(l, att, res)) for l in layers])
        results[batch] = {k: v if v is None else round(v, 3) for k, v in row.items()}
        print(batch, results[batch], flush=True)
        del kv
        torch.cuda.empty_cache()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
