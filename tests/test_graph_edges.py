"""Which captured edges REDLINE_GRAPH_EDGES=launch moves, and its setting (the rewrite itself runs on the GPU:
tests/test_gpu_engine.py)."""
from __future__ import annotations

import pytest

from engine import graph_edges
from engine.graph_edges import PORT_LAUNCH_ORDER, PORT_PROGRAMMATIC, PROGRAMMATIC, Edge


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


@pytest.mark.parametrize("value", ["capture", "launch"])
def test_setting_takes_its_two_values(monkeypatch, value):
    monkeypatch.setenv("REDLINE_GRAPH_EDGES", value)
    assert graph_edges.setting() == value


def test_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("REDLINE_GRAPH_EDGES", "early")
    with pytest.raises(ValueError, match="REDLINE_GRAPH_EDGES must be one of capture, launch; got 'early'"):
        graph_edges.setting()


def test_rows_limit_picks_the_graphs_rewritten(monkeypatch):
    monkeypatch.delenv("REDLINE_GRAPH_EDGES", raising=False)
    monkeypatch.delenv("REDLINE_GRAPH_EDGES_ROWS", raising=False)
    monkeypatch.delenv("REDLINE_GRAPH_EDGES_PAST_ROWS", raising=False)
    assert [graph_edges.rewrites(bs) for bs in (1, 96, 112)] == ["all", "all", "small"]  # the defaults
    monkeypatch.setenv("REDLINE_GRAPH_EDGES_PAST_ROWS", "none")
    assert [graph_edges.rewrites(bs) for bs in (1, 96, 112)] == ["all", "all", None]
    monkeypatch.setenv("REDLINE_GRAPH_EDGES_ROWS", "all")
    assert graph_edges.rewrites(512) == "all"
    monkeypatch.setenv("REDLINE_GRAPH_EDGES_ROWS", "16")
    assert [graph_edges.rewrites(bs) for bs in (8, 16, 32)] == ["all", "all", None]
    monkeypatch.setenv("REDLINE_GRAPH_EDGES_PAST_ROWS", "small")
    assert [graph_edges.rewrites(bs) for bs in (16, 32)] == ["all", "small"]
    monkeypatch.setenv("REDLINE_GRAPH_EDGES", "capture")
    assert graph_edges.rewrites(1) is None
    monkeypatch.setenv("REDLINE_GRAPH_EDGES", "launch")
    monkeypatch.setenv("REDLINE_GRAPH_EDGES_ROWS", "many")
    with pytest.raises(ValueError, match="REDLINE_GRAPH_EDGES_ROWS must be a number of rows or 'all'; got 'many'"):
        graph_edges.rewrites(1)
    monkeypatch.setenv("REDLINE_GRAPH_EDGES_ROWS", "16")
    monkeypatch.setenv("REDLINE_GRAPH_EDGES_PAST_ROWS", "most")
    with pytest.raises(ValueError, match="REDLINE_GRAPH_EDGES_PAST_ROWS must be one of none, small; got 'most'"):
        graph_edges.rewrites(32)
