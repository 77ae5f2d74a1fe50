"""Cases for the receiving kernel of the copy-engine all-reduce (engine/kernels/pushed_sum.py) under the
Triton interpreter. The peers' parts and flags are written into this rank's buffers the way the copy
engines would (here by the test, or by a second process for the waiting cases). Run by
tests/test_pushed_sum.py with TRITON_INTERPRET=1. Prints one JSON object: {case: outcome}.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels.pushed_sum import pushed_sum  # noqa: E402
from engine.layers.fusion import add_rms_norm  # noqa: E402

EPS = 1e-6


def parts_of(world_size: int, rows: int, hidden: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, hidden, generator=gen) * (1 + q)).to(torch.bfloat16) for q in range(world_size)]


def buffers(parts, rank: int, capacity: int, chunks: int, call: int, arrived: bool = True):
    """This rank's slots holding its peers' parts in rank order, and flags saying each chunk arrived."""
    world_size = len(parts)
    peers = [q for q in range(world_size) if q != rank]
    slots = torch.zeros((world_size - 1) * capacity, dtype=torch.bfloat16).share_memory_()
    for i, q in enumerate(peers):
        slots[i * capacity:i * capacity + parts[q].numel()] = parts[q].reshape(-1)
    flags = torch.zeros(chunks * world_size, dtype=torch.int32).share_memory_()
    if arrived:  # as delivered this call, some chunks already overwritten by a later call's flag
        flags.fill_(call)
        flags[world_size - 1::2 * world_size] = call + 1
    return slots, flags


def rank_order_sum(parts) -> torch.Tensor:
    total = torch.zeros(parts[0].shape, dtype=torch.float32)
    for part in parts:
        total += part.float()
    return total.to(parts[0].dtype)


def case_sums(world_size: int, rows: int, hidden: int, chunk_rows: int) -> dict:
    """Every rank's plain and fused results against the rank-order sum and the eager add_rms_norm."""
    chunks = -(-rows // chunk_rows)
    capacity = rows * hidden + 32  # slots larger than the part, as in the engine
    parts = parts_of(world_size, rows, hidden, seed=world_size * 100 + rows)
    gen = torch.Generator().manual_seed(rows)
    residual = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    want_sum = rank_order_sum(parts)
    want_out, want_residual = add_rms_norm(want_sum.clone(), residual.clone(), weight, EPS)
    outcome = {"sum_mismatched": 0, "residual_mismatched": 0, "equal_fraction": 1.0, "worst_relative_error": 0.0}
    stop = torch.zeros(1, dtype=torch.int32)
    for rank in range(world_size):
        slots, flags = buffers(parts, rank, capacity, chunks, call=7)
        got = pushed_sum(parts[rank].clone(), slots, flags, stop, 7, chunk_rows, rank, world_size)
        outcome["sum_mismatched"] += int((got != want_sum).sum())
        res = residual.clone()
        out = pushed_sum(parts[rank].clone(), slots, flags, stop, 7, chunk_rows, rank, world_size,
                         residual=res, weight=weight, eps=EPS)
        outcome["residual_mismatched"] += int((res != want_residual).sum())
        outcome["equal_fraction"] = min(outcome["equal_fraction"], float((out == want_out).float().mean()))
        err = float(((out.float() - want_out.float()).norm() / want_out.float().norm()))
        outcome["worst_relative_error"] = max(outcome["worst_relative_error"], err)
    return outcome


def wait_rank(x, slots, flags, stop, out, call: int, chunk_rows: int) -> None:
    out.copy_(pushed_sum(x, slots, flags, stop, call, chunk_rows, 0, 2))


def case_waits() -> dict:
    """Rank 0's kernel starts before rank 1's last chunk has arrived (its slot still holds zeros and its
    flag an older call): it must wait, then sum what arrives. A second kernel whose peer never delivers
    returns once its stop flag is set."""
    rows, hidden, chunk_rows, call = 4, 64, 2, 5
    parts = parts_of(2, rows, hidden, seed=1)
    slots, flags = buffers(parts, 0, rows * hidden, 2, call)
    late = slice(chunk_rows * hidden, rows * hidden)
    slots[late] = 0
    flags[1 * 2 + 1] = call - 1  # chunk 1 from rank 1: the previous call's
    stop = torch.zeros(1, dtype=torch.int32).share_memory_()
    out = torch.zeros(rows, hidden, dtype=torch.bfloat16).share_memory_()
    lone_slots, lone_flags = buffers(parts, 0, rows * hidden, 2, call, arrived=False)
    lone_stop = torch.zeros(1, dtype=torch.int32).share_memory_()
    lone_out = torch.zeros(rows, hidden, dtype=torch.bfloat16).share_memory_()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=wait_rank, args=(parts[0].clone(), s, f, st, o, call, chunk_rows), daemon=True)
             for s, f, st, o in ((slots, flags, stop, out), (lone_slots, lone_flags, lone_stop, lone_out))]
    for p in procs:
        p.start()
    time.sleep(20)  # the interpreter takes a few seconds to start
    waiting = [p.is_alive() for p in procs]
    slots[late] = parts[1].reshape(-1)[late]  # the copy engine's data, then its flag
    flags[1 * 2 + 1] = call
    procs[0].join(60)
    lone_stop.fill_(1)
    procs[1].join(60)
    for p in procs:
        if p.is_alive():
            p.kill()
    return {"waited_for_late_chunk": waiting[0], "returned_after_arrival": procs[0].exitcode == 0,
            "late_sum_mismatched": int((out != rank_order_sum(parts)).sum()),
            "lone_waited": waiting[1], "lone_returned_after_stop": procs[1].exitcode == 0}


if __name__ == "__main__":
    print(json.dumps({
        "two_ranks": case_sums(2, rows=5, hidden=96, chunk_rows=2),
        "three_ranks": case_sums(3, rows=6, hidden=128, chunk_rows=4),
        "one_chunk": case_sums(2, rows=3, hidden=64, chunk_rows=16),
        **case_waits(),
    }))
