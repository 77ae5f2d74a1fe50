"""Which captured edges the decode graphs open at launch, and in which graphs (the rewrite itself runs on the
GPU: tests/test_gpu_engine.py)."""
from __future__ import annotations

from engine.execution import graph_edges
from engine.execution.graph_edges import PORT_LAUNCH_ORDER, PORT_PROGRAMMATIC, PROGRAMMATIC, Edge


def test_only_programmatic_edges_from_library_gemms_open_at_launch():
    edges = [
        Edge("nvjet_sm90_tst_64x8_64x16_4x2_h_bz_TNT", PROGRAMMATIC, PORT_PROGRAMMATIC),   # GEMM → a PDL kernel
        Edge("_ZN8cublasLt19splitKreduce_kernelILi32E", PROGRAMMATIC, PORT_PROGRAMMATIC),  # its split-K reduction
        Edge("_gemv_kernel", PROGRAMMATIC, PORT_PROGRAMMATIC),          # the engine's own trigger: kept
        Edge("nvjet_sm90_tst_64x8_64x16_4x2_h_bz_TNT", 0, 0),         # full dependency (no PDL below): kept
        Edge(None, PROGRAMMATIC, PORT_PROGRAMMATIC),                     # no readable name: kept
        # a torch kernel may write what the next kernel reads before its wait (the decode order): kept
        Edge("_ZN2at6native27unrolled_elementwise_kernel", PROGRAMMATIC, PORT_PROGRAMMATIC),
        Edge("sm90_xmma_gemm_bf16", PROGRAMMATIC, PORT_LAUNCH_ORDER),    # already at launch: kept
    ]
    assert graph_edges.to_open_at_launch(edges) == [0, 1]


def test_small_scope_leaves_the_edges_into_attention():
    gemm = "nvjet_sm90_tst_64x8_64x16_4x2_h_bz_TNT"
    edges = [
        Edge(gemm, PROGRAMMATIC, PORT_PROGRAMMATIC, "_rms_norm_kernel"),       # a norm after o or down: moved
        Edge(gemm, PROGRAMMATIC, PORT_PROGRAMMATIC, "_fused_decode_kernel"),   # the attention after qkv: kept
        Edge(gemm, PROGRAMMATIC, PORT_PROGRAMMATIC, "_silu_mul_kernel"),       # SiLU·mul after gate_up: moved
        Edge(gemm, PROGRAMMATIC, PORT_PROGRAMMATIC, None),                     # no readable name: kept
        Edge("_gemv_kernel", PROGRAMMATIC, PORT_PROGRAMMATIC, "_rms_norm_kernel"),  # not from a GEMM: kept
    ]
    assert graph_edges.to_open_at_launch(edges, "small") == [0, 2]
    assert graph_edges.to_open_at_launch(edges, "all") == [0, 1, 2, 3]


def test_rows_limit_picks_the_graphs_rewritten():
    assert graph_edges.ALL_EDGES_MAX_ROWS == 96
    assert [graph_edges.rewrites(bs) for bs in (1, 96, 97, 112, 1024)] == ["all", "all", "small", "small", "small"]
