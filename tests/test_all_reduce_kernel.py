"""The one-shot all-reduce kernel under the Triton interpreter, each rank a process of its own over shared
memory (tests/all_reduce_cases.py): exact rank-order sums, flags reset for the next call, and waits a stop
flag calls off (a dead peer must not hang its live ones). On GPUs it runs through tests/test_tp.py."""
from __future__ import annotations

from pathlib import Path

import pytest

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
