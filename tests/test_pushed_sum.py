"""The receiving kernel of the copy-engine all-reduce (engine/kernels/pushed_sum.py) under the Triton
interpreter (tests/pushed_sum_cases.py): exact rank-order sums, the fused residual add and RMSNorm rounded
as the eager layers round, waiting for a chunk until its flag says it arrived, and a stop flag calling a
wait off. The copy engines' side runs on GPUs only (tests/test_tp.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.interpreter import run_under_interpreter

CASES = Path(__file__).with_name("pushed_sum_cases.py")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_under_interpreter(CASES)


@pytest.mark.parametrize("case", ["two_ranks", "three_ranks", "one_chunk"])
def test_every_rank_gets_the_rank_order_sum_and_the_eager_residual_and_norm(results, case):
    outcome = results[case]
    assert outcome["sum_mismatched"] == 0
    assert outcome["residual_mismatched"] == 0
    # the kernel sums the mean's squares in another order than torch: a rare rounding may differ
    assert outcome["worst_relative_error"] <= 1e-2
    assert outcome["equal_fraction"] >= 0.95


def test_a_chunk_is_summed_only_once_its_flag_says_it_arrived(results):
    outcome = results["waited_for_late_chunk"], results["returned_after_arrival"], results["late_sum_mismatched"]
    assert outcome == (True, True, 0)


def test_a_wait_for_a_peer_that_never_delivers_returns_once_the_stop_flag_is_set(results):
    assert results["lone_waited"] and results["lone_returned_after_stop"]
