"""GPU check of the skinny GEMM (engine/kernels/skinny_gemm.py) against F.linear (cuBLAS).

    PYTHONPATH=. python3 scripts/gemm_check.py [--out DIR] [--budget-s S] [--dry-run]

For the Qwen3-0.6B / Qwen3-8B / 8B-TP=2 projection shapes and M in 1..256: times cuBLAS and
skinny_linear with the choose_config heuristic (do_bench, and a CUDA graph of back-to-back calls that
cycle through enough weight copies that L2 holds none), checks each skinny result against cuBLAS,
then sweeps a few configs for M <= 64 (0.6B shapes first; later sweeps are dropped past --budget-s).
Prints tables, the 28-layer 0.6B decode-step GEMM total, and finally one JSON line with every figure.
--dry-run runs tiny shapes on CPU under the Triton interpreter through the same code, timing nothing.
Imports only torch, triton and engine.kernels.skinny_gemm.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

REL_TOL = 1e-2
M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOTAL_MAX_M = 256
NUM_LAYERS_06B = 28
L2_FLUSH_BYTES = 200 << 20   # graph calls cycle through this many bytes of weight copies (H100 L2: 50 MiB)
MIN_GRAPH_CALLS = 20
LAYER_GEMMS = ("qkv", "o", "gate_up", "down")

# (model, layer, N, K)
SHAPES = [
    ("0.6B", "qkv", 4096, 1024), ("0.6B", "o", 1024, 2048), ("0.6B", "gate_up", 6144, 1024),
    ("0.6B", "down", 1024, 3072), ("0.6B", "lm_head", 151936, 1024),
    ("8B", "qkv", 6144, 4096), ("8B", "o", 4096, 4096), ("8B", "gate_up", 24576, 4096),
    ("8B", "down", 4096, 12288),
    ("8B-tp2", "qkv", 3072, 4096), ("8B-tp2", "o", 4096, 2048), ("8B-tp2", "gate_up", 12288, 4096),
    ("8B-tp2", "down", 4096, 6144),
]
# --dry-run: the same names with tiny, block-unaligned sizes
DRY_SHAPES = [(model, layer, 24 + 8 * i, 40 + 24 * (i % 3)) for i, (model, layer, _, _) in enumerate(SHAPES)]
DRY_M_VALUES = (1, 3, 16, 65)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write gemm_check.json into this folder")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="start no config sweep after this many seconds")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on CPU under the Triton interpreter; no timing")
    parser.add_argument("--models", default="", help="only these models of SHAPES, e.g. 8B-tp2,8B")
    parser.add_argument("--m-values", default="", help="rows to time, e.g. 32,64,128,256 (default: 1..256)")
    parser.add_argument("--sweep-max-m", type=int, default=64, help="sweep configs up to this many rows")
    parser.add_argument("--sweep-graphs", action="store_true",
                        help="time every sweep config in a CUDA graph (as a decode step runs it) and pick the best "
                             "by that; plain timing counts a split's second launch and its partials' allocation")
    parser.add_argument("--large-splits", default="",
                        help="past 64 rows, sweep each tile with these K splits, e.g. 1,2,4 (default: the heuristic's)")
    return parser.parse_args()


ARGS = parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.kernels.skinny_gemm import SkinnyConfig, choose_config, choose_split_k, skinny_linear  # noqa: E402

# Sweep candidates; each gets its split from choose_split_k. The reduce path is tried for M <= 8.
REDUCE_SWEEP = [
    SkinnyConfig(block_n=8, block_k=256, num_warps=4, num_stages=3),
    SkinnyConfig(block_n=8, block_k=512, num_warps=4, num_stages=3),
    SkinnyConfig(block_n=16, block_k=256, num_warps=4, num_stages=3),
    SkinnyConfig(block_n=16, block_k=256, num_warps=4, num_stages=1),
    SkinnyConfig(block_n=16, block_k=512, num_warps=4, num_stages=3),
    SkinnyConfig(block_n=16, block_k=512, num_warps=4, num_stages=1),
    SkinnyConfig(block_n=32, block_k=256, num_warps=4, num_stages=3),
    SkinnyConfig(block_n=32, block_k=512, num_warps=8, num_stages=3),
]
DOT_SWEEP = [
    SkinnyConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, use_dot=True, swap_ab=True),
    SkinnyConfig(block_n=128, block_k=128, num_warps=4, num_stages=3, use_dot=True, swap_ab=True),
    SkinnyConfig(block_n=64, block_k=256, num_warps=4, num_stages=3, use_dot=True, swap_ab=True),
    SkinnyConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, use_dot=True, swap_ab=False),
    SkinnyConfig(block_n=32, block_k=256, num_warps=4, num_stages=3, use_dot=True, swap_ab=False),
    SkinnyConfig(block_n=128, block_k=64, num_warps=8, num_stages=4, use_dot=True, swap_ab=True),
    SkinnyConfig(block_n=128, block_k=128, num_warps=8, num_stages=3, use_dot=True, swap_ab=False),
    SkinnyConfig(block_n=64, block_k=64, num_warps=4, num_stages=6, use_dot=True, swap_ab=True),
]
# past 64 rows: ordinary tiles (x on the MMA's M side), 64 or 128 rows a program
LARGE_M_SWEEP = [
    SkinnyConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st, use_dot=True, swap_ab=False)
    for bm, bn, bk, w, st in [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (64, 128, 128, 8, 3),
                              (128, 64, 64, 4, 4), (128, 64, 128, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 3),
                              (64, 256, 64, 8, 3), (128, 256, 64, 8, 3), (64, 64, 256, 4, 3), (32, 128, 128, 4, 4),
                              (64, 128, 64, 4, 6), (128, 128, 64, 8, 5), (64, 64, 128, 4, 5)]
]
REDUCE_SWEEP_MAX_M = 8
REDUCE_MAX_TILE = 16384  # block_m * block_n * block_k of the reduce path's broadcast product


def sweep_configs(M: int, N: int, K: int, num_sms: int, heuristic: SkinnyConfig) -> list[SkinnyConfig]:
    """The heuristic with split 1 and with doubled split, then every candidate that fits M with its
    split from choose_split_k."""
    candidates = [replace(heuristic, split_k=1), replace(heuristic, split_k=2 * heuristic.split_k)]
    tried = list(DOT_SWEEP) if M <= 64 else list(LARGE_M_SWEEP)
    if M <= REDUCE_SWEEP_MAX_M:
        m_pad = triton.next_power_of_2(M)
        tried = [c for c in REDUCE_SWEEP if m_pad * c.block_n * c.block_k <= REDUCE_MAX_TILE] + tried
    if M > 64 and ARGS.large_splits:
        candidates += [replace(c, split_k=int(s)) for c in tried for s in ARGS.large_splits.split(",")]
    else:
        candidates += [replace(c, split_k=choose_split_k(M, N, K, c, num_sms)) for c in tried]
    configs, seen = [], {heuristic.name}
    for config in candidates:
        if config.name not in seen:
            seen.add(config.name)
            configs.append(config)
    return configs


# ---- timing ---------------------------------------------------------------------------------------

def bench_us(fn) -> float:
    """Median µs of one call, L2 flushed before each (do_bench's default)."""
    if ARGS.dry_run:
        fn()
        return 1.0
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3


def graph_us(gemm, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """µs per call of a CUDA graph of back-to-back gemm(x, w) calls cycling through `weights`."""
    if ARGS.dry_run:
        gemm(x, weights[0])
        return 1.0
    calls = max(MIN_GRAPH_CALLS, len(weights))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        for i in range(min(calls, 2)):
            gemm(x, weights[i % len(weights)])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            gemm(x, weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    us = bench_us(graph.replay) / calls
    del graph
    return us


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def gb_per_s(N: int, K: int, us: float | None) -> float | None:
    return None if not us else N * K * 2 / (us * 1e-6) / 1e9


def guarded(measure) -> tuple[float | None, str | None]:
    """(value, None), or (None, the error) when a compile, launch or capture fails."""
    try:
        return measure(), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc)[:300]}"


def try_skinny(config: SkinnyConfig, x, w, ref) -> dict:
    """Time one config and check it; an error or a wrong result is recorded, not raised."""
    gemm = functools.partial(skinny_linear, config=config)
    try:
        err = relative_error(gemm(x, w), ref)
        if not err < REL_TOL:
            return {"config": config.name, "error": f"relative error {err:.3g}"}
        return {"config": config.name, "us": bench_us(lambda: gemm(x, w)), "err": err}
    except Exception as exc:  # a config that fails to compile must not end the run
        return {"config": config.name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


class Problem:
    """One (shape, M): inputs, the cuBLAS reference and weight copies for graph timing."""

    def __init__(self, shape: tuple, M: int, device: str, dtype: torch.dtype):
        self.model, self.layer, self.N, self.K = shape
        self.M = M
        gen = torch.Generator(device=device).manual_seed(M * 7919 + self.N)
        self.x = torch.randn(M, self.K, generator=gen, device=device).to(dtype)
        copies = 1 if ARGS.dry_run else max(1, min(50, math.ceil(L2_FLUSH_BYTES / (self.N * self.K * 2))))
        self.weights = [torch.randn(self.N, self.K, generator=gen, device=device).to(dtype) for _ in range(copies)]
        self.w = self.weights[0]
        self.ref = F.linear(self.x, self.w)


# ---- phases ---------------------------------------------------------------------------------------

def measure_core(p: Problem, num_sms: int) -> dict:
    """cuBLAS and the heuristic config, plain and in a graph."""
    config = choose_config(p.M, p.N, p.K, num_sms)
    row = {"model": p.model, "layer": p.layer, "N": p.N, "K": p.K, "M": p.M, "heuristic": config.name}
    row["cublas_us"], cublas_error = guarded(lambda: bench_us(lambda: F.linear(p.x, p.w)))
    row["cublas_graph_us"], cublas_graph_error = guarded(lambda: graph_us(F.linear, p.x, p.weights))
    result = try_skinny(config, p.x, p.w, p.ref)
    row["skinny_us"], row["skinny_err"] = result.get("us"), result.get("err")
    row["skinny_graph_us"], graph_error = None, None
    if "error" not in result:
        gemm = functools.partial(skinny_linear, config=config)
        row["skinny_graph_us"], graph_error = guarded(lambda: graph_us(gemm, p.x, p.weights))
    errors = {"cublas": cublas_error, "cublas_graph": cublas_graph_error, "skinny": result.get("error"),
              "skinny_graph": graph_error}
    if any(errors.values()):
        row["errors"] = "; ".join(f"{k}: {v}" for k, v in errors.items() if v)
    row["best"], row["best_us"], row["best_graph_us"] = config.name, row["skinny_us"], row["skinny_graph_us"]
    return row


def measure_sweep(p: Problem, row: dict, num_sms: int) -> None:
    """Try the sweep configs; the fastest (heuristic included) becomes row['best'], timed in a graph too."""
    heuristic = choose_config(p.M, p.N, p.K, num_sms)
    configs = {c.name: c for c in sweep_configs(p.M, p.N, p.K, num_sms, heuristic)}
    results = [try_skinny(c, p.x, p.w, p.ref) for c in configs.values()]
    if ARGS.sweep_graphs:  # replace each plain time by the graph time
        for r in results:
            if "us" in r:
                gemm = functools.partial(skinny_linear, config=configs[r["config"]])
                us, error = guarded(lambda: graph_us(gemm, p.x, p.weights))
                r.pop("us")
                r.update({"us": us} if us is not None else {"error": error})
        if row["skinny_graph_us"] is not None:
            row["skinny_us"] = row["skinny_graph_us"]
    row["sweep"] = {r["config"]: r.get("us", r.get("error")) for r in results}
    timed = [r for r in results if "us" in r]
    if row["skinny_us"] is not None:
        timed.append({"config": heuristic.name, "us": row["skinny_us"]})
    if not timed:
        return
    best = min(timed, key=lambda r: r["us"])
    if best["config"] == row["best"]:
        return
    config = configs[best["config"]]
    row["best"], row["best_us"] = best["config"], best["us"]
    gemm = functools.partial(skinny_linear, config=config)
    row["best_graph_us"], row["best_graph_error"] = guarded(lambda: graph_us(gemm, p.x, p.weights))


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def decode_step_totals(rows: list[dict], m_values: tuple) -> list[dict]:
    """Sum of one 0.6B decode step's GEMMs: 28 x (qkv + o + gate_up + down) + LM head."""
    totals = []
    for M in m_values:
        if M > TOTAL_MAX_M:
            continue
        by_layer = {r["layer"]: r for r in rows if r["model"] == "0.6B" and r["M"] == M}
        if set(by_layer) != set(LAYER_GEMMS) | {"lm_head"}:
            continue
        entry = {"M": M}
        for field in ("cublas_us", "cublas_graph_us", "skinny_us", "skinny_graph_us", "best_us", "best_graph_us"):
            values = {layer: by_layer[layer][field] for layer in by_layer}
            if any(v is None for v in values.values()):
                entry[field] = None
                continue
            entry[field] = NUM_LAYERS_06B * sum(values[g] for g in LAYER_GEMMS) + values["lm_head"]
        # per GEMM, the faster of cuBLAS and the best skinny config (graph timings)
        pick = {layer: min((v for v in (r["cublas_graph_us"], r["best_graph_us"]) if v is not None), default=None)
                for layer, r in by_layer.items()}
        entry["mixed_graph_us"] = (None if None in pick.values() else
                                   NUM_LAYERS_06B * sum(pick[g] for g in LAYER_GEMMS) + pick["lm_head"])
        totals.append(entry)
    return totals


# ---- report ---------------------------------------------------------------------------------------

def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def format_tables(rows: list[dict], totals: list[dict]) -> str:
    lines = ["", "# per GEMM: µs (weight GB/s); ratio = skinny / cuBLAS (< 1: skinny faster); "
                 "best = fastest config by do_bench, g.ratio its graph ratio",
             f"{'shape':22} {'M':>4} | {'cuBLAS':>14} {'skinny':>14} {'ratio':>5} | {'graph cuBLAS':>12} "
             f"{'graph skinny':>12} {'ratio':>5} | {'best config':28} {'best':>7} {'ratio':>5} {'g.ratio':>7} | err"]
    for r in rows:
        N, K = r["N"], r["K"]
        lines.append(
            f"{r['model'] + '/' + r['layer'] + f' {N}x{K}':22} {r['M']:>4} | "
            f"{fmt(r['cublas_us']):>6} ({fmt(gb_per_s(N, K, r['cublas_us']), '.0f'):>5}) "
            f"{fmt(r['skinny_us']):>6} ({fmt(gb_per_s(N, K, r['skinny_us']), '.0f'):>5}) "
            f"{fmt(ratio(r['skinny_us'], r['cublas_us']), '.2f'):>5} | "
            f"{fmt(r['cublas_graph_us']):>12} {fmt(r['skinny_graph_us']):>12} "
            f"{fmt(ratio(r['skinny_graph_us'], r['cublas_graph_us']), '.2f'):>5} | "
            f"{r['best']:28} {fmt(r['best_us']):>7} {fmt(ratio(r['best_us'], r['cublas_us']), '.2f'):>5} "
            f"{fmt(ratio(r['best_graph_us'], r['cublas_graph_us']), '.2f'):>7} | "
            f"{fmt(r['skinny_err'], '.1e')} {r.get('errors', '')}")
    lines += ["", f"# Qwen3-0.6B decode step, GEMMs only: {NUM_LAYERS_06B} x (qkv + o + gate_up + down) + lm_head, "
                  "µs (g. = in a CUDA graph; mixed = per GEMM the faster of cuBLAS and best)",
              f"{'M':>3} | {'cuBLAS':>8} {'skinny':>8} {'best':>8} | {'g.cuBLAS':>8} {'g.skinny':>8} "
              f"{'g.best':>8} {'g.mixed':>8} | g.best/g.cuBLAS"]
    for t in totals:
        lines.append(
            f"{t['M']:>3} | {fmt(t['cublas_us']):>8} {fmt(t['skinny_us']):>8} {fmt(t['best_us']):>8} | "
            f"{fmt(t['cublas_graph_us']):>8} {fmt(t['skinny_graph_us']):>8} {fmt(t['best_graph_us']):>8} "
            f"{fmt(t['mixed_graph_us']):>8} | {fmt(ratio(t['best_graph_us'], t['cublas_graph_us']), '.2f')}")
    return "\n".join(lines)


def main() -> int:
    start = time.time()
    device = "cpu" if ARGS.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run to run the code paths on CPU", file=sys.stderr)
        return 2
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
    info = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (interpreter)",
            "num_sms": num_sms, "torch": torch.__version__, "triton": triton.__version__,
            "dry_run": ARGS.dry_run, "budget_s": ARGS.budget_s}
    print(json.dumps(info))
    shapes = DRY_SHAPES if ARGS.dry_run else SHAPES
    if ARGS.models:
        shapes = [s for s in shapes if s[0] in ARGS.models.split(",")]
    m_values = DRY_M_VALUES if ARGS.dry_run else M_VALUES
    if ARGS.m_values:
        m_values = tuple(int(m) for m in ARGS.m_values.split(","))
    dtype = torch.bfloat16

    rows = []
    for shape in shapes:  # phase 1: cuBLAS vs the heuristic everywhere
        for M in m_values:
            rows.append(measure_core(Problem(shape, M, device, dtype), num_sms))
            r = rows[-1]
            print(f"core {r['model']}/{r['layer']}/M{M}: cuBLAS {fmt(r['cublas_us'])} µs, "
                  f"{r['heuristic']} {fmt(r['skinny_us'])} µs {r.get('errors', '')}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    info["core_s"] = round(time.time() - start, 1)

    skipped = []
    for row in rows:  # phase 2: sweeps, in SHAPES order (0.6B first) while the budget lasts
        if row["M"] > ARGS.sweep_max_m:
            continue
        if time.time() - start > ARGS.budget_s:
            skipped.append(f"{row['model']}/{row['layer']}/M{row['M']}")
            continue
        shape = (row["model"], row["layer"], row["N"], row["K"])
        measure_sweep(Problem(shape, row["M"], device, dtype), row, num_sms)
        print(f"sweep {row['model']}/{row['layer']}/M{row['M']}: best {row['best']} {fmt(row['best_us'])} µs",
              flush=True)
    info["sweeps_skipped"] = skipped
    info["total_s"] = round(time.time() - start, 1)

    totals = decode_step_totals(rows, m_values)
    bad = [f"{r['model']}/{r['layer']}/M{r['M']}: {r['errors']}" for r in rows if "errors" in r]
    info["failures"] = bad
    tables = format_tables(rows, totals) + (
        f"\n\n{len(rows)} problems, {len(bad)} failures, {len(skipped)} sweeps skipped, {info['total_s']} s"
        + "".join(f"\n  FAIL {line}" for line in bad))
    print(tables)
    result = {"info": info, "rows": rows, "decode_step_06b": totals}
    if ARGS.out:
        ARGS.out.mkdir(parents=True, exist_ok=True)
        (ARGS.out / "gemm_check.txt").write_text(tables + "\n")
        (ARGS.out / "gemm_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
