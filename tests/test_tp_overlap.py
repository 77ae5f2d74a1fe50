"""Row-parallel projections that start their all-reduce chunk by chunk (TPGroup.partial_linear), on CPU
over gloo: the same sums as computing first and summing after, and the same tokens as TP=1."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.test_tp import TIGHT_CACHE, _prompts, _run, run_two_ranks

_TWO_RANKS = """
import torch, torch.distributed as dist
import torch.nn.functional as F


def inputs(rank, rows):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(rows, 24, generator=g)
    w = torch.randn(16, 24, generator=g)
    b = torch.randn(16, generator=g) if rank == 0 else torch.zeros(16)  # a row-parallel bias lives on rank 0
    return x, w, b


def rank_main(rank, folder, queue):
    from engine.layers.linear import RowParallelLinear
    from engine.layers.parallel import ReducingSum, TPGroup
    dist.init_process_group("gloo", init_method=f"file://{folder}/group", rank=rank, world_size=2)
    tp = TPGroup(rank, 2, overlap_chunks=3, overlap_min_rows=40)
    report = {}
    for rows in (37, 40, 101):
        x, w, b = inputs(rank, rows)
        want = sum(F.linear(*inputs(r, rows)) for r in range(2))
        got = tp.partial_linear(x, w, b)
        chunked = isinstance(got, ReducingSum)
        chunks = len(got.works) if chunked else 0
        summed = got.wait() if chunked else tp.all_reduce(got)
        layer = RowParallelLinear(48, 16, bias=True, tp=tp)
        layer.weight.data.copy_(w)
        layer.bias.data.copy_(b)
        report[rows] = {"chunked": chunked, "chunks": chunks, "max_error": (summed - want).abs().max().item(),
                        "layer_error": (layer(x) - want).abs().max().item()}
    queue.put([rank, report])
    dist.destroy_process_group()
"""


def test_chunked_row_parallel_sum_equals_the_sum_of_the_whole_products(tmp_path):
    result = run_two_ranks(_TWO_RANKS, tmp_path)
    assert result["hung"] == [], result
    results = result["ranks"]
    assert [rank for rank, _ in results] == [0, 1]
    for _, report in results:
        assert not report["37"]["chunked"]  # fewer rows than overlap_min_rows: summed later, whole
        assert report["40"]["chunked"] and report["40"]["chunks"] == 3  # rows 0-15, 16-31, 32-39
        assert report["101"]["chunked"] and report["101"]["chunks"] == 3  # rows 0-47, 48-95, 96-100
        for rows in ("37", "40", "101"):
            assert report[rows]["max_error"] < 1e-4, report
            assert report[rows]["layer_error"] < 1e-4, report


@pytest.mark.timeout(300)
def test_tp2_with_every_projection_overlapped_gives_tp1_tokens(qwen3_checkpoint, monkeypatch):
    prompts = _prompts(seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    expected = _run(LLM(str(qwen3_checkpoint), **TIGHT_CACHE), prompts, greedy)
    monkeypatch.setenv("REDLINE_TP_OVERLAP_MIN_ROWS", "2")  # every step of more than one token
    monkeypatch.setenv("REDLINE_TP_OVERLAP_CHUNKS", "3")
    llm = LLM(str(qwen3_checkpoint), tensor_parallel_size=2, **TIGHT_CACHE)
    try:
        assert llm.runner.runner.tp.overlap_min_rows == 2
        assert _run(llm, prompts, greedy) == expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("value", ["0", "four", "-2"])
def test_bad_overlap_setting_is_a_clear_error(qwen3_checkpoint, monkeypatch, value):
    monkeypatch.setenv("REDLINE_TP_OVERLAP_CHUNKS", value)
    with pytest.raises(ValueError, match=f"REDLINE_TP_OVERLAP_CHUNKS must be a positive integer, got '{value}'"):
        LLM(str(qwen3_checkpoint), device="cpu", tensor_parallel_size=2)


@pytest.mark.parametrize("name, value, message", [
    ("REDLINE_TP_COPY_CHUNKS", "0", "REDLINE_TP_COPY_CHUNKS must be a positive integer, got '0'"),
    ("REDLINE_TP_ONE_SHOT_MAX_BYTES", "8MB", "REDLINE_TP_ONE_SHOT_MAX_BYTES must be a positive integer, got '8MB'"),
    ("REDLINE_TP_LARGE_ALL_REDUCE", "dma", "REDLINE_TP_LARGE_ALL_REDUCE must be 'copy' or 'nccl', got 'dma'"),
])
def test_bad_large_all_reduce_setting_is_a_clear_error(qwen3_checkpoint, monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        LLM(str(qwen3_checkpoint), device="cpu", tensor_parallel_size=2)
