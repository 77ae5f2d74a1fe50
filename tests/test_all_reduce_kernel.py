"""The one-shot all-reduce kernel under the Triton interpreter, each rank a process of its own over shared
memory (tests/all_reduce_cases.py): exact rank-order sums, flags reset for the next call, and waits a stop
flag calls off (a dead peer must not hang its live ones). On GPUs it runs through tests/test_tp.py."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.interpreter import run_under_interpreter

CASES = Path(__file__).with_name("all_reduce_cases.py")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_under_interpreter(CASES)


@pytest.mark.parametrize("world_size", ["two_ranks", "three_ranks"])
def test_every_rank_gets_the_rank_order_sum_rounded_once_and_the_flags_reset(results, world_size):
    outcome = results[world_size]
    assert outcome["finished"], "a rank did not return"
    assert outcome["mismatched"] == 0
    assert outcome["flags_left"] == 0  # the next call starts from clean flags


def test_a_rank_waiting_on_a_peer_that_never_comes_returns_once_its_stop_flag_is_set(results):
    outcome = results["stop"]
    assert outcome["waited_for_peer"]
    assert outcome["returned_after_stop"]


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_one_gpu_two_ranks_on_two_streams_sum_exactly_and_a_stop_flag_releases_a_lone_rank():
    """Both "ranks" are streams of one GPU over plain device buffers: the kernels meet while both run, the
    sums are exact, and a rank whose peer never comes returns once its stop flag is copied in from a side
    stream (the copy engine writes it while the kernel spins)."""
    from engine.kernels.all_reduce import BLOCK, MAX_PROGRAMS, one_shot_all_reduce

    def ranks(capacity):
        bufs = [torch.zeros(capacity, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        flags = [torch.zeros(2 * MAX_PROGRAMS * 2, dtype=torch.int32, device="cuda") for _ in range(2)]
        ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device="cuda") for ts in (bufs, flags)]
        return bufs, flags, ptrs, [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2)]

    streams = [torch.cuda.Stream() for _ in range(2)]
    sizes = [1, BLOCK + 5, MAX_PROGRAMS * BLOCK * 3 + 7]
    bufs, flags, (buf_ptrs, flag_ptrs), stops = ranks(max(sizes))
    # compile and load the kernel first: loading a module while the other "rank" spins could wait for it
    stops[0].fill_(1)
    one_shot_all_reduce(bufs[0][:1], bufs[0][:1], buf_ptrs, flag_ptrs, stops[0], 0, 2)
    torch.cuda.synchronize()
    for t in (*flags, *stops):
        t.zero_()
    mismatched = 0
    for n in sizes * 2:
        xs = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(2)]
        outs = [torch.empty_like(x) for x in xs]
        torch.cuda.synchronize()
        for rank in range(2):
            with torch.cuda.stream(streams[rank]):
                one_shot_all_reduce(xs[rank], outs[rank], buf_ptrs, flag_ptrs, stops[rank], rank, 2)
        torch.cuda.synchronize()
        want = (xs[0].float() + xs[1].float()).to(torch.bfloat16)
        mismatched += sum(int((out != want).sum()) for out in outs)
    assert mismatched == 0
    assert sum(int(f.abs().sum()) for f in flags) == 0

    bufs, flags, (buf_ptrs, flag_ptrs), stops = ranks(BLOCK)
    x = torch.ones(BLOCK, dtype=torch.bfloat16, device="cuda")
    with torch.cuda.stream(streams[0]):
        one_shot_all_reduce(x, x, buf_ptrs, flag_ptrs, stops[0], 0, 2)  # rank 1 never calls
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
