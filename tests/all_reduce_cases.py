"""Cases for the one-shot all-reduce kernels under the Triton interpreter: each rank is a process of its
own, and every rank's buffers are shared host memory that each process maps at its own
addresses, as GPUs map their peers' memory. Run by tests/test_all_reduce_kernel.py with
TRITON_INTERPRET=1. Prints one JSON object: {case: outcome}.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels.all_reduce import (BLOCK, buffer_elements, clear_buffer, one_shot_all_reduce,  # noqa: E402
                                       one_shot_all_reduce_add_rms_norm)
from engine.layers.fusion import add_rms_norm  # noqa: E402

PROGRAMS = 2  # few programs, so small inputs already take several iterations per program
EPS = 1e-6


def shared(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype).share_memory_()


def addresses(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def sum_rank(rank: int, world_size: int, bufs, state, stop, calls) -> None:
    """Reduce each call's xs[rank] into its outs[rank], one call after another; odd calls in place."""
    for i, (xs, outs) in enumerate(calls):
        x = xs[rank]
        if i % 2:
            x = outs[rank].copy_(x)
        one_shot_all_reduce(x, outs[rank], addresses(bufs), state, stop, rank, world_size, PROGRAMS)


def norm_rank(rank: int, world_size: int, bufs, state, stop, calls) -> None:
    """Each call's fused all-reduce, residual add and RMSNorm on this rank's tensors; odd calls write out
    over x."""
    for i, (xs, residuals, weight, outs) in enumerate(calls):
        x = xs[rank]
        if i % 2:
            x = outs[rank].copy_(x)
        one_shot_all_reduce_add_rms_norm(x, residuals[rank], weight, EPS, outs[rank], addresses(bufs),
                                         state, stop, rank, world_size, PROGRAMS)


def start_ranks(target, ranks: list[int], world_size: int, capacity: int, calls):
    """Processes running target for `ranks`, over fresh buffers of `capacity` elements a slot."""
    bufs = [clear_buffer(shared(buffer_elements(capacity, world_size))) for _ in range(world_size)]
    states = [shared(PROGRAMS, dtype=torch.int32) for _ in range(world_size)]
    stops = [shared(1, dtype=torch.int32) for _ in range(world_size)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world_size, bufs, states[r], stops[r], calls), daemon=True)
             for r in ranks]
    for p in procs:
        p.start()
    return procs, (bufs, states), stops


def leftovers(shared_state, calls: int) -> dict:
    """After `calls` calls on every rank: elements of any buffer not holding the sentinel again, and
    program counters not at `calls`."""
    bufs, states = shared_state
    sentinel = clear_buffer(torch.empty(1, dtype=torch.bfloat16)).view(torch.int16)
    return {"buffer_left": sum(int((b.view(torch.int16) != sentinel).sum()) for b in bufs),
            "counters_off": sum(int((s != calls).sum()) for s in states)}


def finish(procs) -> bool:
    for p in procs:
        p.join(300)
    if any(p.is_alive() or p.exitcode for p in procs):
        for p in procs:
            p.kill()
        return False
    return True


def with_negative_zeros(x: torch.Tensor, rank: int) -> torch.Tensor:
    """x with -0.0 at every third element from `rank` on: the bit pattern free slots hold, which must
    travel as a value and not stall the wait (at every sixth element, two ranks send it together)."""
    x[rank::3] = -0.0
    return x


def rank_order_sum(xs) -> torch.Tensor:
    return torch.stack([x.float() for x in xs]).sum(0).to(xs[0].dtype)


def case_sums(world_size: int, sizes: list[int], rounds: int = 2) -> dict:
    """Every rank gets the rank-order float32 sum rounded once, over repeated calls (the flags reset),
    into a separate output and in place."""
    gen = torch.Generator().manual_seed(world_size)
    calls = [([with_negative_zeros(torch.randn(n, generator=gen).to(torch.bfloat16), rank).share_memory_()
               for rank in range(world_size)], [shared(n) for _ in range(world_size)])
             for n in sizes for _ in range(rounds)]
    procs, shared_state, _ = start_ranks(sum_rank, list(range(world_size)), world_size, max(sizes), calls)
    if not finish(procs):
        return {"finished": False}
    mismatched = sum(int((out != rank_order_sum(xs)).sum()) for xs, outs in calls for out in outs)
    return {"finished": True, "mismatched": mismatched, **leftovers(shared_state, len(calls))}


def case_add_rms_norm(world_size: int, shapes: list[tuple[int, int]]) -> dict:
    """Every rank's residual becomes exactly the eager bf16 sum of the reduced x and the residual, and its
    output matches add_rms_norm run eagerly up to the order of the mean's sum."""
    gen = torch.Generator().manual_seed(10 + world_size)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(torch.bfloat16)

    calls, wants = [], []
    for rows, hidden in shapes:
        xs = [randn(rows, hidden).share_memory_() for _ in range(world_size)]
        residual, weight = randn(rows, hidden), randn(hidden, scale=0.1, shift=1.0).share_memory_()
        calls.append((xs, [residual.clone().share_memory_() for _ in range(world_size)], weight,
                      [shared(rows, hidden) for _ in range(world_size)]))
        wants.append(add_rms_norm(rank_order_sum(xs), residual, weight, EPS))
    procs, shared_state, _ = start_ranks(norm_rank, list(range(world_size)), world_size,
                                  max(rows * hidden for rows, hidden in shapes), calls)
    if not finish(procs):
        return {"finished": False}
    residual_mismatched, worst_error, equal, total = 0, 0.0, 0, 0
    for (_, residuals, _, outs), (want_out, want_residual) in zip(calls, wants):
        residual_mismatched += sum(int((r != want_residual).sum()) for r in residuals)
        for out in outs:
            error = (out.float() - want_out.float()).abs().max() / want_out.float().abs().max()
            worst_error = max(worst_error, float(error))
            equal += int((out == want_out).sum())
            total += out.numel()
    return {"finished": True, "residual_mismatched": residual_mismatched, "worst_relative_error": worst_error,
            "equal_fraction": equal / total, **leftovers(shared_state, len(calls))}


def case_stops() -> dict:
    """Rank 1 never calls either kernel: each lone rank 0 waits until its stop flag is set, then returns.
    Both kernels' lone ranks run side by side, so the interpreter's start-up is waited out once."""
    rows, hidden = 3, 96
    ones = [torch.ones(BLOCK, dtype=torch.bfloat16).share_memory_() for _ in range(2)]
    sum_calls = [(ones, [shared(BLOCK) for _ in range(2)])]
    rows_of_ones = [torch.ones(rows, hidden, dtype=torch.bfloat16).share_memory_() for _ in range(2)]
    norm_calls = [(rows_of_ones, [shared(rows, hidden) for _ in range(2)], torch.ones(hidden, dtype=torch.bfloat16),
                   [shared(rows, hidden) for _ in range(2)])]
    lone = {"stop": start_ranks(sum_rank, [0], 2, BLOCK, sum_calls),
            "add_rms_norm_stop": start_ranks(norm_rank, [0], 2, rows * hidden, norm_calls)}
    time.sleep(20)  # the interpreter takes a few seconds to start
    outcomes = {}
    for name, (procs, _, stops) in lone.items():
        waiting = procs[0].is_alive()
        start = time.monotonic()
        stops[0].fill_(1)
        procs[0].join(60)
        outcomes[name] = {"waited_for_peer": waiting, "returned_after_stop": procs[0].exitcode == 0,
                          "seconds_to_return": round(time.monotonic() - start, 1)}
        if procs[0].is_alive():
            procs[0].kill()
    return outcomes


if __name__ == "__main__":
    print(json.dumps({
        "two_ranks": case_sums(2, [1, 7, BLOCK, BLOCK + 5, 2 * PROGRAMS * BLOCK + 11]),
        "three_ranks": case_sums(3, [5, PROGRAMS * BLOCK + 3], rounds=1),
        "add_rms_norm_two_ranks": case_add_rms_norm(2, [(1, 96), (3, 96), (5, 96), (5, 96)]),
        "add_rms_norm_three_ranks": case_add_rms_norm(3, [(1, 96), (3, 96), (5, 128)]),
        **case_stops(),
    }))
