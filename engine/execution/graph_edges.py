"""Decode graphs whose PDL kernels are let in at the launch of a cuBLAS GEMM before them.

A kernel launched with PDL is captured behind a programmatic edge. It may be scheduled once every block
of the kernel before it has called launch_dependents or exited; its wait_for_previous returns when that
kernel has completed and its writes are visible (engine/kernels/launch.py). The engine's kernels let
their dependents in first thing. cuBLAS's GEMMs never do, so a norm, SiLU·mul or attention kernel after
a GEMM is scheduled only when the GEMM's last block exits.

`open_at_launch` moves those edges (a GEMM upstream, programmatic) to the launch-order port, which opens
once every block of the GEMM has begun. The dependent's blocks can then be placed beside the GEMM's last
wave and wait there. Its wait still returns only after the GEMM has completed, so the results are those
of stream order. Edges from other kernels keep their trigger.

Graphs of up to ALL_EDGES_MAX_ROWS rows get every such edge rewritten; larger ones only the edges into
kernels that are not attention (the norms and SiLU·mul). The driver is called through ctypes (libcuda's
graph API, CUDA 12.3 and later).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

KERNEL_NODE = 0               # CU_GRAPH_NODE_TYPE_KERNEL
PROGRAMMATIC = 1              # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
PORT_PROGRAMMATIC = 1         # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC: all blocks triggered or exited
PORT_LAUNCH_ORDER = 2         # CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER: all blocks begun
logger = logging.getLogger(__name__)
# Every edge from a GEMM rewritten took 4-8% off a 0.6B decode step at 8-64 rows, 1% at 96, and cost 1-2% at
# 128 and 256 (H100, 6379109); past this, the edges into attention stay as captured.
ALL_EDGES_MAX_ROWS = 96


def rewrites(batch_rows: int) -> str:
    """Which edges the decode graph of this batch size gets rewritten: "all" (every programmatic edge from a
    GEMM), or past ALL_EDGES_MAX_ROWS rows "small" (those into kernels other than attention: -0.3 to -2.8% a
    decode step at 128-256 rows, nano-bench -1.1% on the H100, d03d38d)."""
    return "all" if batch_rows <= ALL_EDGES_MAX_ROWS else "small"


@dataclass(frozen=True)
class Edge:
    upstream: str | None  # the upstream kernel's name; None where it is no kernel or has no readable name
    type: int
    from_port: int
    downstream: str | None = None  # the downstream kernel's name, the same way


def is_library_gemm(name: str) -> bool:
    """Whether a kernel name is one of cuBLAS's / cuBLASLt's GEMM kernels (their split-K reduction too)."""
    return name.startswith("nvjet") or any(part in name for part in ("cublasLt", "cutlass", "xmma", "gemm"))


def is_attention(name: str) -> bool:
    """Whether a kernel name is one of the engine's decode attention kernels."""
    return "decode" in name


def to_open_at_launch(edges: list[Edge], scope: str = "all") -> list[int]:
    """Indices of the edges to move to the launch-order port: programmatic edges from a library GEMM; with
    scope "small", only those into a named kernel that is not attention.

    Only GEMMs: what follows one in a decode graph reads before its wait only what no kernel of the step
    writes (weights, the step's inputs). A torch kernel upstream may write what the next kernel reads
    early: the fused decode kernel reads the decode order, which torch's sort writes, before its wait.
    """
    return [i for i, e in enumerate(edges)
            if e.type == PROGRAMMATIC and e.from_port == PORT_PROGRAMMATIC
            and e.upstream is not None and is_library_gemm(e.upstream)
            and (scope == "all" or (e.downstream is not None and not is_attention(e.downstream)))]


class _EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """libcuda with the graph API used here, or None (a driver older than CUDA 12.3: edges left as captured)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuGraphGetEdges_v2", "cuGraphNodeGetType", "cuGraphKernelNodeGetParams_v2", "cuFuncGetName",
                     "cuKernelGetName", "cuGraphRemoveDependencies_v2", "cuGraphAddDependencies_v2"):
            getattr(lib, name).restype = ctypes.c_int
    except (OSError, AttributeError) as e:
        logger.warning("decode graphs keep their captured edges: the CUDA driver lacks the graph edge API (%s)", e)
        return None
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


def _kernel_name(lib: ctypes.CDLL, node: int) -> str | None:
    kind = ctypes.c_int(-1)
    if lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) != 0 or kind.value != KERNEL_NODE:
        return None
    params = _KernelNodeParams()
    if lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params)) != 0:
        return None
    name = ctypes.c_char_p()
    if params.func and lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)) == 0 and name.value:
        return name.value.decode(errors="replace")
    if params.kern and lib.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern)) == 0 and name.value:
        return name.value.decode(errors="replace")
    return None


def _edges(lib: ctypes.CDLL, graph: ctypes.c_void_p):
    count = ctypes.c_size_t(0)
    _check(lib.cuGraphGetEdges_v2(graph, None, None, None, ctypes.byref(count)), "cuGraphGetEdges")
    upstream = (ctypes.c_void_p * count.value)()
    downstream = (ctypes.c_void_p * count.value)()
    data = (_EdgeData * count.value)()
    _check(lib.cuGraphGetEdges_v2(graph, upstream, downstream, data, ctypes.byref(count)), "cuGraphGetEdges")
    return upstream, downstream, data, count.value


def open_at_launch(raw_graph: int, scope: str = "all") -> dict[str, int]:
    """Rewrite a captured, not yet instantiated graph (torch.cuda.CUDAGraph(keep_graph=True) and its
    raw_cuda_graph()) as the module docstring says, the edges of `scope` (to_open_at_launch). Returns
    {upstream kernel name: edges moved}."""
    lib = _driver()
    if lib is None:
        return {}
    graph = ctypes.c_void_p(raw_graph)
    upstream, downstream, data, count = _edges(lib, graph)
    names: dict[int, str | None] = {}
    edges = []
    for i in range(count):
        for node in (upstream[i] or 0, downstream[i] or 0):
            if node not in names:
                names[node] = _kernel_name(lib, node) if node else None
        edges.append(Edge(names[upstream[i] or 0], data[i].type, data[i].from_port, names[downstream[i] or 0]))
    moved: dict[str, int] = {}
    for i in to_open_at_launch(edges, scope):
        old = _EdgeData(data[i].from_port, data[i].to_port, data[i].type)
        new = _EdgeData(PORT_LAUNCH_ORDER, 0, PROGRAMMATIC)
        pair = (ctypes.c_void_p * 1)(upstream[i]), (ctypes.c_void_p * 1)(downstream[i])
        _check(lib.cuGraphRemoveDependencies_v2(graph, *pair, ctypes.byref(old), 1), "cuGraphRemoveDependencies")
        _check(lib.cuGraphAddDependencies_v2(graph, *pair, ctypes.byref(new), 1), "cuGraphAddDependencies")
        moved[edges[i].upstream] = moved.get(edges[i].upstream, 0) + 1
    return moved

