"""The one-shot all-reduce kernels under the Triton interpreter, each rank a process of its own over shared
memory (tests/all_reduce_cases.py): exact rank-order sums, the fused residual add and RMSNorm rounded as
the eager layers round, buffers clean again for the next call, and waits a stop flag calls off (a dead peer must
not hang its live ones). On GPUs they run through tests/test_tp.py."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.layers.fusion import add_rms_norm
from engine.layers.parallel import TPGroup
from tests.interpreter import run_under_interpreter

CASES = Path(__file__).with_name("all_reduce_cases.py")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_under_interpreter(CASES)


@pytest.mark.parametrize("world_size", ["two_ranks", "three_ranks"])
def test_every_rank_gets_the_rank_order_sum_rounded_once_and_the_buffers_are_clean_again(results, world_size):
    outcome = results[world_size]
    assert outcome["finished"], "a rank did not return"
    assert outcome["mismatched"] == 0
    assert outcome["buffer_left"] == 0  # every slot holds the sentinel again, ready for its next call
    assert outcome["counters_off"] == 0  # every program of every rank counted every call


@pytest.mark.parametrize("world_size", ["add_rms_norm_two_ranks", "add_rms_norm_three_ranks"])
def test_fused_add_rms_norm_gives_every_rank_the_eager_residual_and_normed_rows(results, world_size):
    outcome = results[world_size]
    assert outcome["finished"], "a rank did not return"
    assert outcome["residual_mismatched"] == 0  # the reduced rows plus the residual, rounded as eager bf16
    # the kernel sums the mean's squares in another order than torch: a rare rounding may differ
    assert outcome["worst_relative_error"] <= 1e-2
    assert outcome["equal_fraction"] >= 0.95
    assert outcome["buffer_left"] == 0 and outcome["counters_off"] == 0


@pytest.mark.parametrize("kernel", ["stop", "add_rms_norm_stop"])
def test_a_rank_waiting_on_a_peer_that_never_comes_returns_once_its_stop_flag_is_set(results, kernel):
    outcome = results[kernel]
    assert outcome["waited_for_peer"]
    assert outcome["returned_after_stop"]


def test_add_rms_norm_of_a_single_rank_group_is_add_rms_norm():
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(3, 96, generator=gen).to(torch.bfloat16) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(torch.bfloat16)
    out, new_residual = TPGroup().all_reduce_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    want_out, want_residual = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(out, want_out) and torch.equal(new_residual, want_residual)


def _two_ranks_on_one_gpu(capacity: int):
    """Buffers (parts of up to `capacity` elements), program counters and stop flags of two "ranks" that
    are streams of one GPU, and the buffers' address tensor."""
    from engine.kernels.all_reduce import PROGRAMS, buffer_elements, clear_buffer

    bufs = [clear_buffer(torch.empty(buffer_elements(capacity, 2), dtype=torch.bfloat16, device="cuda"))
            for _ in range(2)]
    states = [torch.zeros(PROGRAMS, dtype=torch.int32, device="cuda") for _ in range(2)]
    buf_ptrs = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.int64, device="cuda")
    stops = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2)]
    return bufs, states, buf_ptrs, stops


def _clean(bufs) -> bool:
    from engine.kernels.all_reduce import clear_buffer

    return all(torch.equal(b.view(torch.int16), clear_buffer(torch.empty_like(b)).view(torch.int16)) for b in bufs)


def _on_two_streams(call) -> None:
    """call(rank) for both ranks at once, each on a stream of its own."""
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    for rank in range(2):
        with torch.cuda.stream(streams[rank]):
            call(rank)
    torch.cuda.synchronize()


def _warm_up(call, bufs, states, stops) -> None:
    """Compile and load a kernel first (a lone call its stop flag releases at once): loading a module
    while the other "rank" spins could wait for it. Then everything back to a fresh start."""
    from engine.kernels.all_reduce import clear_buffer

    stops[0].fill_(1)
    call()
    torch.cuda.synchronize()
    for t in (*states, *stops):
        t.zero_()
    for b in bufs:
        clear_buffer(b)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_one_gpu_two_ranks_on_two_streams_sum_exactly_and_a_stop_flag_releases_a_lone_rank():
    """Both "ranks" are streams of one GPU over plain device buffers: the kernels meet while both run, the
    sums are exact (into separate outputs and in place), and a rank whose peer never comes returns once
    its stop flag is copied in from a side stream (the copy engine writes it while the kernel spins)."""
    from engine.kernels.all_reduce import BLOCK, PROGRAMS, one_shot_all_reduce

    sizes = [1, BLOCK + 5, PROGRAMS * BLOCK * 3 + 7]
    bufs, states, buf_ptrs, stops = _two_ranks_on_one_gpu(max(sizes))
    one = torch.ones(1, dtype=torch.bfloat16, device="cuda")
    _warm_up(lambda: one_shot_all_reduce(one, one.clone(), buf_ptrs, states[0], stops[0], 0, 2), bufs, states, stops)
    mismatched = 0
    for i, n in enumerate(sizes * 2):
        xs = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(2)]
        want = (xs[0].float() + xs[1].float()).to(torch.bfloat16)
        outs = xs if i >= len(sizes) else [torch.empty_like(x) for x in xs]
        _on_two_streams(lambda r: one_shot_all_reduce(xs[r], outs[r], buf_ptrs, states[r], stops[r], r, 2))
        mismatched += sum(int((out != want).sum()) for out in outs)
    assert mismatched == 0
    assert _clean(bufs)

    bufs, states, buf_ptrs, stops = _two_ranks_on_one_gpu(BLOCK)
    x = torch.ones(BLOCK, dtype=torch.bfloat16, device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()):
        one_shot_all_reduce(x, x, buf_ptrs, states[0], stops[0], 0, 2)  # rank 1 never calls
        done = torch.cuda.Event()
        done.record()
    time.sleep(0.5)
    assert not done.query()  # waiting for the peer
    one = torch.ones(1, dtype=torch.int32, pin_memory=True)
    with torch.cuda.stream(torch.cuda.Stream()):
        stops[0].copy_(one, non_blocking=True)
    deadline = time.monotonic() + 10
    while not done.query() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done.query()


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_one_gpu_two_ranks_on_two_streams_fuse_the_all_reduce_with_add_rms_norm():
    """The fused kernel on two streams of one GPU: every rank's residual is the eager bf16 sum of the
    reduced rows and the residual, and its output the RMSNorm of it up to the order of the mean's sum."""
    from engine.kernels.all_reduce import PROGRAMS, one_shot_all_reduce_add_rms_norm

    hidden, eps = 4096, 1e-6
    row_counts = [1, 7, 2 * PROGRAMS + 3]  # the last: programs loop over rows
    bufs, states, buf_ptrs, stops = _two_ranks_on_one_gpu(max(row_counts) * hidden)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    row = torch.ones(1, hidden, dtype=torch.bfloat16, device="cuda")
    _warm_up(lambda: one_shot_all_reduce_add_rms_norm(row, row.clone(), weight, eps, row, buf_ptrs, states[0],
                                                      stops[0], 0, 2), bufs, states, stops)
    residual_mismatched, worst_error, equal, total = 0, 0.0, 0, 0
    for rows in row_counts:
        xs = [torch.randn(rows, hidden, device="cuda").to(torch.bfloat16) for _ in range(2)]
        residual = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
        want_out, want_residual = add_rms_norm((xs[0].float() + xs[1].float()).to(torch.bfloat16), residual,
                                               weight, eps)
        residuals = [residual.clone() for _ in range(2)]
        _on_two_streams(lambda r: one_shot_all_reduce_add_rms_norm(
            xs[r], residuals[r], weight, eps, xs[r], buf_ptrs, states[r], stops[r], r, 2))
        residual_mismatched += sum(int((res != want_residual).sum()) for res in residuals)
        for out in xs:
            error = (out.float() - want_out.float()).abs().max() / want_out.float().abs().max()
            worst_error = max(worst_error, float(error))
            equal += int((out == want_out).sum())
            total += out.numel()
    assert residual_mismatched == 0
    assert worst_error <= 1e-2 and equal / total >= 0.95
    assert _clean(bufs)
