"""The TMA GEMM (engine/kernels/tma_gemm.py) against cuBLAS on the 0.6B decode projections (H100).

    PYTHONPATH=. python3 scripts/tma_gemm_time.py [--out DIR] [--m-values 16,64,256] [--budget-s 300]

1. Checks: every shape and row count against F.linear (relative error < 1e-2; the output poisoned first,
   every element written), each config twice (split tickets reset).
2. Per projection and row count, µs a call in a CUDA graph of back-to-back calls that cycle through enough
   weight copies that L2 holds none: cuBLAS, the default config, and a sweep (best kept).
3. A decode step's projections: 28 layers of qkv, o, gate_up and down with their own weights, one graph,
   cuBLAS against the kernel (default configs, and the sweep's best), with and without PDL.
Prints tables, then one JSON line.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from engine.kernels.tma_gemm import TmaConfig, default_config, tma_linear
from overlap_check import captured

SHAPES = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)]
LAYERS = 28
L2_FLUSH_BYTES = 200 << 20
MIN_CALLS = 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--m-values", default="16,64,128,256")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop sweeping after this many seconds")
    return p.parse_args()


def median_us(fn, reps: int = 30) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=reps, return_mode="median") * 1e3


def graph_us(calls_fn, calls: int) -> float:
    """µs per call of a CUDA graph of `calls` back-to-back calls_fn(i)."""
    graph = captured(lambda: [calls_fn(i) for i in range(calls)])
    us = median_us(graph.replay) / calls
    del graph
    return us


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def sweep_configs(M: int, N: int, K: int) -> list[TmaConfig]:
    k_tiles = triton.cdiv(K, 64)
    configs = []
    for bm, bn, split in itertools.product((64, 128), (16, 32, 64, 128), (1, 2, 4)):
        if bm == 128 and M <= 64:
            continue
        if bn == 16 and N > 2048:
            continue
        if k_tiles % split or k_tiles // split < 2:
            continue
        most = max(2, min(8, k_tiles // split, (200 << 10) // ((bm + bn) * 64 * 2)))
        for stages in sorted({2, 4, most}):
            if stages <= most:
                configs.append(TmaConfig(bm, bn, 64, stages, split))
    return configs


def smem_bytes(c: TmaConfig) -> int:
    """Shared memory a program of config c takes (its rings, and the output tile without a split)."""
    return c.stages * (c.block_m + c.block_n) * c.block_k * 2 + (c.block_m * c.block_n * 2 if c.split == 1 else 0)


SMALL_SMEM = 112 << 10  # two programs of this size fit on an SM: the next kernel's can start beside this one's


def check(device) -> list[str]:
    failures = []
    for (name, N, K), M in itertools.product(SHAPES, (1, 5, 16, 64, 100, 128, 200, 256)):
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16) / K ** 0.5
        ref = F.linear(x, w)
        for config in [default_config(M, N, K)] + sweep_configs(M, N, K)[::5]:
            for attempt in range(2):
                out = torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)
                tma_linear(x, w, out, config)
                torch.cuda.synchronize()
                err = rel_err(out, ref)
                if not (err < 1e-2) or torch.isnan(out).any():
                    failures.append(f"{name} M={M} {config} attempt {attempt}: rel err {err:.3g}")
    return failures


def main() -> int:
    args = parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    t0 = time.time()
    failures = check(device)
    print(f"checks: {len(failures)} failures ({time.time() - t0:.0f} s)", flush=True)
    for f in failures[:20]:
        print("  FAIL", f)
    m_values = [int(v) for v in args.m_values.split(",")]
    rows, best, small = [], {}, {}
    start = time.time()
    for name, N, K in SHAPES:
        copies = max(2, L2_FLUSH_BYTES // (N * K * 2))
        weights = [torch.randn(N, K, device=device, dtype=torch.bfloat16) / K ** 0.5 for _ in range(copies)]
        calls = max(MIN_CALLS, copies)
        for M in m_values:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            out = torch.empty(M, N, device=device, dtype=torch.bfloat16)
            cublas = graph_us(lambda i: torch.mm(x, weights[i % copies].t(), out=out), calls)
            default = default_config(M, N, K)
            d_us = graph_us(lambda i: tma_linear(x, weights[i % copies], out, default), calls)
            b_cfg, b_us = default, d_us
            s_cfg, s_us = (default, d_us) if smem_bytes(default) <= SMALL_SMEM else (None, float("inf"))
            if time.time() - start < args.budget_s:
                for config in sweep_configs(M, N, K):
                    if config == default:
                        continue
                    try:
                        us = graph_us(lambda i: tma_linear(x, weights[i % copies], out, config), calls)
                    except Exception as e:  # a config that does not compile or launch: reported, skipped
                        print(f"  {name} M={M} {config}: {type(e).__name__}: {str(e)[:100]}")
                        continue
                    if us < b_us:
                        b_cfg, b_us = config, us
                    if us < s_us and smem_bytes(config) <= SMALL_SMEM:
                        s_cfg, s_us = config, us
            best[(name, M)] = b_cfg
            small[(name, M)] = s_cfg or b_cfg
            row = {"gemm": name, "M": M, "cublas_us": cublas, "default_us": d_us, "default": str(default),
                   "best_us": b_us, "best": str(b_cfg), "small_us": s_us, "small": str(s_cfg)}
            rows.append(row)
            s_cfg = s_cfg or b_cfg
            print(f"{name:8s} M={M:4d} cublas {cublas:6.2f}  default {d_us:6.2f} ({default.block_m}x"
                  f"{default.block_n}/{default.split})  best {b_us:6.2f} ({b_cfg.block_m}x{b_cfg.block_n}"
                  f"/{b_cfg.split} s{b_cfg.stages})  small {s_us:6.2f} ({s_cfg.block_m}x{s_cfg.block_n}"
                  f"/{s_cfg.split} s{s_cfg.stages})", flush=True)
    # a step's projections, 28 layers with their own weights
    layer_w = [[torch.randn(N, K, device=device, dtype=torch.bfloat16) / K ** 0.5 for name, N, K in SHAPES]
               for _ in range(LAYERS)]
    chain = []
    for M in m_values:
        xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _, N, K in SHAPES]
        outs = [torch.empty(M, N, device=device, dtype=torch.bfloat16) for _, N, K in SHAPES]

        def step(gemm):
            def run(_):
                for layer in layer_w:
                    for j, w in enumerate(layer):
                        gemm(j, xs[j], w, outs[j])
            return run

        cub = graph_us(step(lambda j, x, w, o: torch.mm(x, w.t(), out=o)), 1)
        res = {"M": M, "cublas_ms": cub / 1e3}
        for label, pdl in (("pdl", "1"), ("no_pdl", "0")):
            os.environ["REDLINE_PDL"] = pdl
            res[f"default_{label}_ms"] = graph_us(step(
                lambda j, x, w, o: tma_linear(x, w, o, default_config(M, w.shape[0], w.shape[1]))), 1) / 1e3
            res[f"best_{label}_ms"] = graph_us(step(
                lambda j, x, w, o: tma_linear(x, w, o, best[(SHAPES[j][0], M)])), 1) / 1e3
            res[f"small_{label}_ms"] = graph_us(step(
                lambda j, x, w, o: tma_linear(x, w, o, small[(SHAPES[j][0], M)])), 1) / 1e3
        os.environ["REDLINE_PDL"] = "1"
        chain.append(res)
        print(f"step M={M:4d}: cublas {res['cublas_ms']:.3f} ms; default {res['default_pdl_ms']:.3f} "
              f"(no PDL {res['default_no_pdl_ms']:.3f}); best {res['best_pdl_ms']:.3f} "
              f"(no PDL {res['best_no_pdl_ms']:.3f}); small {res['small_pdl_ms']:.3f} "
              f"(no PDL {res['small_no_pdl_ms']:.3f})", flush=True)
    result = {"device": torch.cuda.get_device_name(), "failures": failures, "rows": rows, "chain": chain}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tma_gemm_time.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
