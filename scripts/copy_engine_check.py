"""The copy-engine all-reduce of prefill steps (engine/layers/parallel.CopyEngineSum) against NCCL, part by part,
on a 2-GPU machine.

    python scripts/copy_engine_check.py [--rows 16384] [--hidden 4096] [--inner 2048,6144] [--out DIR]

Two processes (one per GPU) time, with CUDA events (eager, as prefill steps run), for a row-parallel
projection of [rows, inner] @ [inner, hidden] per rank (the Qwen3-8B shape at TP=2: o_proj inner 2048,
down_proj 6144): the GEMM alone; GEMM, NCCL all-reduce, residual add + RMSNorm (what prefill steps did);
the copy-engine path (chunked GEMM, copies, the fused receiving kernel) at 1, 2, 4 and 8 chunks; one
copy of the whole output into the peer's buffer alone (copy-engine bandwidth over NVLink); the GEMM with
that copy running beside it; and the receiving kernel alone once every chunk has arrived. Checks that
the copy-engine results equal NCCL's exactly. Prints one JSON line per rank and writes copy_engine_check.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(_name, _value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, repeat: int) -> float:
    """Milliseconds per call of fn (after one warm-up), the ranks started together."""
    import torch
    import torch.distributed as dist

    fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / repeat, 4)


def rank_main(rank: int, port: int, rows: int, hidden: int, inners: list[int], repeat: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from engine.layers.fusion import add_rms_norm
    from engine.layers.parallel import CopyEngineSum, OneShotAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    device = torch.device("cuda", rank)
    assert OneShotAllReduce.create(device, torch.bfloat16, rank, 2) is not None
    pushed = CopyEngineSum.create(device, torch.bfloat16, rank, 2, rows * hidden, 8)
    assert pushed is not None
    gen = torch.Generator(device="cuda").manual_seed(rank)
    weight_norm = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    residual0 = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    result = {"rank": rank, "rows": rows, "hidden": hidden, "ms": {}, "mismatched": {}}
    for inner in inners:
        x = torch.randn(rows, inner, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(hidden, inner, device="cuda", generator=gen) / inner ** 0.5).to(torch.bfloat16)
        ms = result["ms"][inner] = {}
        ms["gemm"] = timed(lambda: torch.mm(x, w.t()), repeat)

        def nccl_path():
            part = torch.mm(x, w.t())
            dist.all_reduce(part)
            return add_rms_norm(part, residual0.clone(), weight_norm, 1e-6)
        ms["gemm+nccl+norm"] = timed(nccl_path, repeat)
        part = torch.mm(x, w.t())
        ms["nccl alone"] = timed(lambda: dist.all_reduce(part), repeat)
        want_out, want_residual = nccl_path()

        for chunks in (1, 2, 4, 8):
            pushed.chunks = chunks

            def copy_path():
                pending = pushed.start(x, w, None)
                residual = residual0.clone()
                return pushed.finish(pending, residual, weight_norm, 1e-6), residual
            ms[f"copy engine, {chunks} chunks"] = timed(copy_path, repeat)
            out, residual = copy_path()
            result["mismatched"][f"{inner}/{chunks}"] = [int((out != want_out).sum()),
                                                         int((residual != want_residual).sum())]
            torch.cuda.synchronize()
            dist.barrier()  # the peer has read its slots before anything below writes into them
        # the copy engine alone: this rank's whole output into its slot of the peer's buffer
        peer = 1 - rank
        target = pushed.peer_data[peer][:rows * hidden]
        flat = part.reshape(-1)
        ms["one copy to the peer"] = timed(lambda: target.copy_(flat), repeat)
        result.setdefault("copy_GBps", round(flat.numel() * 2 / ms["one copy to the peer"] / 1e6, 1))
        side = torch.cuda.Stream()

        def gemm_beside_copy():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                target.copy_(flat)
            torch.mm(x, w.t())
            torch.cuda.current_stream().wait_stream(side)
        ms["gemm beside one copy"] = timed(gemm_beside_copy, repeat)
        # the receiving kernel alone, every chunk already there
        pushed.chunks = 4
        pending = pushed.start(x, w, None)
        torch.cuda.synchronize()
        dist.barrier()
        ms["receiving kernel, arrived"] = timed(
            lambda: pushed.finish(pending, residual0.clone(), weight_norm, 1e-6), repeat)
        ms["norm kernel alone"] = timed(lambda: add_rms_norm(part.clone(), residual0.clone(), weight_norm, 1e-6),
                                        repeat)
        torch.cuda.synchronize()
        dist.barrier()
    queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import socket

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inner", default="2048,6144")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    inners = [int(v) for v in args.inner.split(",")]
    procs = [ctx.Process(target=rank_main, args=(r, port, args.rows, args.hidden, inners, args.repeat, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(60)
    for r in results:
        print(json.dumps(r))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "copy_engine_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
