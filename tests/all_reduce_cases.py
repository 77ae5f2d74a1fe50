"""Cases for the one-shot all-reduce kernel under the Triton interpreter: each rank is a process of its
own, and every rank's buffers and flags are shared host memory that each process maps at its own
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

from engine.kernels.all_reduce import BLOCK, one_shot_all_reduce  # noqa: E402

PROGRAMS = 2  # few programs, so small inputs already take several iterations per program


def shared(*shape, dtype) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype).share_memory_()


def rank_main(rank: int, world_size: int, bufs, flags, stop, inputs, outputs) -> None:
    """Reduce inputs[i][rank] into outputs[i][rank] for each i, one call after another."""
    buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    for xs, outs in zip(inputs, outputs):
        one_shot_all_reduce(xs[rank], outs[rank], buf_ptrs, flag_ptrs, stop, rank, world_size, PROGRAMS)


def start_ranks(ranks: list[int], world_size: int, capacity: int, inputs):
    bufs = [shared(capacity, dtype=torch.bfloat16) for _ in range(world_size)]
    flags = [shared(2 * PROGRAMS * world_size, dtype=torch.int32) for _ in range(world_size)]
    stops = [shared(1, dtype=torch.int32) for _ in range(world_size)]
    outputs = [[torch.zeros_like(x).share_memory_() for x in xs] for xs in inputs]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world_size, bufs, flags, stops[r], inputs, outputs), daemon=True)
             for r in ranks]
    for p in procs:
        p.start()
    return procs, outputs, flags, stops


def case_sums(world_size: int, sizes: list[int], rounds: int = 2) -> dict:
    """Every rank gets the rank-order float32 sum rounded once, over repeated calls (the flags reset)."""
    gen = torch.Generator().manual_seed(world_size)
    inputs = [[torch.randn(n, generator=gen).to(torch.bfloat16).share_memory_() for _ in range(world_size)]
              for n in sizes for _ in range(rounds)]
    procs, outputs, flags, _ = start_ranks(list(range(world_size)), world_size, max(sizes), inputs)
    for p in procs:
        p.join(300)
    if any(p.is_alive() or p.exitcode for p in procs):
        for p in procs:
            p.kill()
        return {"finished": False}
    mismatched = 0
    for xs, outs in zip(inputs, outputs):
        want = torch.stack([x.float() for x in xs]).sum(0).to(torch.bfloat16)
        mismatched += sum(int((out != want).sum()) for out in outs)
    return {"finished": True, "mismatched": mismatched, "flags_left": sum(int(f.abs().sum()) for f in flags)}


def case_stop() -> dict:
    """Rank 1 never calls: rank 0 waits until its stop flag is set, then returns."""
    inputs = [[torch.ones(BLOCK, dtype=torch.bfloat16).share_memory_() for _ in range(2)]]
    procs, _, _, stops = start_ranks([0], 2, BLOCK, inputs)
    procs[0].join(20)  # the interpreter takes a few seconds to start
    waiting = procs[0].is_alive()
    start = time.monotonic()
    stops[0].fill_(1)
    procs[0].join(60)
    returned = procs[0].exitcode == 0
    if procs[0].is_alive():
        procs[0].kill()
    return {"waited_for_peer": waiting, "returned_after_stop": returned,
            "seconds_to_return": round(time.monotonic() - start, 1)}


if __name__ == "__main__":
    print(json.dumps({
        "two_ranks": case_sums(2, [1, 7, BLOCK + 5, 2 * PROGRAMS * BLOCK + 11]),
        "three_ranks": case_sums(3, [5, PROGRAMS * BLOCK + 3], rounds=1),
        "stop": case_stop(),
    }))
