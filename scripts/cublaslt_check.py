"""GPU check: do cuBLASLt's other algorithms beat the one PyTorch's F.linear runs, for the decode projections?

    PYTHONPATH=. python3 scripts/cublaslt_check.py [--m-values 8,16,...] [--shapes qkv,o,...] [--algos 64] [--out DIR]

For the Qwen3-0.6B projection shapes and decode row counts: asks cuBLASLt's heuristic for up to --algos
algorithms of y = x @ w.T (bf16 in and out, fp32 accumulation), and times each, and F.linear, in a CUDA
graph of back-to-back calls that cycle through enough weight copies that L2 holds none (as a decode step
meets its weights). Each algorithm's output is compared with F.linear's (relative error) and with its own
second run (bit for bit: a split-K reduction must not depend on timing). Prints, per shape and row count,
F.linear, the heuristic's first choice, and the fastest algorithm with its configuration (tile, split-K,
stages, cluster), then the 28-layer sum of a decode step's four projections. One JSON line at the end.

cuBLASLt is reached through ctypes (libcublasLt, which PyTorch loads); nothing is built.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}
LAYER = ("qkv", "o", "gate_up", "down")
LAYERS = 28
L2_FLUSH_BYTES = 200 << 20
MIN_CALLS = 20
WORKSPACE = 32 << 20

# cublasLt.h / library_types.h / cublas_api.h values
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
OP_N, OP_T = 0, 1
ALGO_CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "stages": 6, "cluster": 8}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLt:
    """The few cuBLASLt calls a row-major y[M, N] = x[M, K] @ w[N, K].T needs."""

    def __init__(self):
        F.linear(torch.zeros(8, 8, device="cuda"), torch.zeros(8, 8, device="cuda"))  # loads libcublasLt
        self.lib = None
        for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if self.lib is None:
            raise RuntimeError("libcublasLt not found")
        self.handle = ctypes.c_void_p()
        self._ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} returned cuBLAS status {status}")

    def problem(self, M: int, N: int, K: int):
        """(matmul desc, A, B, C layouts) of y^T[N, M] = w[N, K] (A, transposed) @ x^T[K, M] (B), column-major."""
        lib = self.lib
        desc = ctypes.c_void_p()
        self._ok(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "DescCreate")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            value = ctypes.c_int32(op)
            self._ok(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.c_size_t(4)),
                     "DescSetAttribute")
        layouts = []
        for rows, cols, ld in ((K, N, K), (K, M, K), (N, M, N)):
            layout = ctypes.c_void_p()
            self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), CUDA_R_16BF, ctypes.c_uint64(rows),
                                                    ctypes.c_uint64(cols), ctypes.c_int64(ld)), "LayoutCreate")
            layouts.append(layout)
        return desc, *layouts

    def heuristics(self, problem, count: int) -> list[HeuristicResult]:
        desc, a, b, c = problem
        pref = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(WORKSPACE)
        self._ok(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                               ctypes.c_size_t(8)),
                 "PreferenceSetAttribute")
        results = (HeuristicResult * count)()
        returned = ctypes.c_int(0)
        self._ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, count, results,
                                                         ctypes.byref(returned)), "AlgoGetHeuristic")
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def config(self, algo: Algo) -> dict:
        out = {}
        for name, attr in ALGO_CONFIG.items():
            value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                                   ctypes.c_size_t(4),
                                                                   ctypes.byref(written))
            out[name] = value.value if status == 0 else None
        return out

    def matmul(self, problem, algo: Algo, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        desc, a, b, c = problem
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._ok(self.lib.cublasLtMatmul(self.handle, desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), a,
                                         ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self.beta),
                                         ctypes.c_void_p(y.data_ptr()), c, ctypes.c_void_p(y.data_ptr()), c,
                                         ctypes.byref(algo), ctypes.c_void_p(self.workspace.data_ptr()),
                                         ctypes.c_size_t(WORKSPACE), stream), "cublasLtMatmul")


def graph_us(call, weights: list[torch.Tensor]) -> float:
    """µs per call of a CUDA graph of back-to-back call(w) over `weights` (median of replays)."""
    from triton.testing import do_bench
    calls = max(MIN_CALLS, len(weights))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(weights[0])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    us = do_bench(graph.replay, warmup=5, rep=30, return_mode="median") * 1e3 / calls
    del graph
    return us


def measure(lt: CublasLt, name: str, M: int, count: int) -> dict:
    N, K = SHAPES[name]
    copies = max(2, min(64, L2_FLUSH_BYTES // (N * K * 2) + 1))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, weights[0])
    row = {"shape": name, "M": M, "N": N, "K": K,
           "torch_us": graph_us(lambda w: torch.mm(x, w.t(), out=y), weights)}
    problem = lt.problem(M, N, K)
    algos = []
    for rank, result in enumerate(lt.heuristics(problem, count)):
        algo = result.algo
        try:
            lt.matmul(problem, algo, x, weights[0], y)
            first = y.clone()
            lt.matmul(problem, algo, x, weights[0], y)
            torch.cuda.synchronize()
            repeatable = bool(torch.equal(first, y))
            err = ((first.float() - ref.float()).norm() / ref.float().norm()).item()
            us = graph_us(lambda w, a=algo: lt.matmul(problem, a, x, w, y), weights)
        except RuntimeError as exc:
            algos.append({"rank": rank, "error": str(exc)})
            continue
        algos.append({"rank": rank, "us": us, "rel_err": err, "repeatable": repeatable,
                      "workspace": result.workspace_size, "waves": result.waves_count, **lt.config(algo)})
    usable = [a for a in algos if "us" in a and a["rel_err"] < 1e-2 and a["repeatable"]]
    row["heuristic_first"] = next((a for a in algos if a.get("rank") == 0 and "us" in a), None)
    row["best"] = min(usable, key=lambda a: a["us"]) if usable else None
    row["algos"] = algos
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m-values", default="5,8,16,24,32,48,64,96,128,192,256")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--algos", type=int, default=64, help="algorithms to ask the heuristic for")
    parser.add_argument("--out", type=Path, default=None, help="write cublaslt_check.json here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    m_values = [int(m) for m in args.m_values.split(",") if m]
    lt = CublasLt()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    print("| shape | M | F.linear µs | heuristic #0 µs | best µs | best / F.linear | best: rank, tile, split-K, "
          "stages, cluster, reduction | algos |", flush=True)
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |", flush=True)
    rows = []
    for name in shapes:
        for M in m_values:
            row = measure(lt, name, M, args.algos)
            rows.append(row)
            first, best = row["heuristic_first"], row["best"]
            desc = (f"{best['rank']}, {best['tile']}, {best['splitk']}, {best['stages']}, {best['cluster']}, "
                    f"{best['reduction']}" if best else "-")
            print(f"| {name} | {M} | {row['torch_us']:.2f} | {first['us'] if first else float('nan'):.2f} | "
                  f"{best['us'] if best else float('nan'):.2f} | "
                  f"{(best['us'] / row['torch_us']) if best else float('nan'):.3f} | {desc} | {len(row['algos'])} |",
                  flush=True)
    print("\n| M | 4 projections x 28, F.linear ms | the same, best algorithms ms | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    totals = []
    for M in m_values:
        layer = [r for r in rows if r["M"] == M and r["shape"] in LAYER]
        if len(layer) != len(LAYER) or not all(r["best"] for r in layer):
            continue
        torch_ms = LAYERS * sum(r["torch_us"] for r in layer) / 1e3
        best_ms = LAYERS * sum(r["best"]["us"] for r in layer) / 1e3
        totals.append({"M": M, "torch_ms": torch_ms, "best_ms": best_ms})
        print(f"| {M} | {torch_ms:.3f} | {best_ms:.3f} | {best_ms / torch_ms:.3f} |")
    summary = {"device": torch.cuda.get_device_name(), "totals": totals,
               "rows": [{k: v for k, v in r.items() if k != "algos"} for r in rows]}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cublaslt_check.json").write_text(json.dumps({**summary, "rows": rows}, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
