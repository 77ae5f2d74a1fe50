"""All-reduce time on a 2-GPU machine under several NCCL settings, as decode steps use it (inside CUDA graphs).

    python scripts/allreduce_check.py --out $OUT [--settings default,NCCL_PROTO=LL,...]

For each setting (environment variables NCCL reads when a communicator is made, or the engine's own such as
REDLINE_TP_AR_PROGRAMS=256, which time only the engine's kernels; `+` joins several), two
fresh processes make a communicator, capture --repeat all-reduces of each size into a CUDA graph and time
its replays. With the default setting two symmetric-memory one-shot all-reduces are timed too: the engine's
(engine/kernels/all_reduce.py, "symm") and PyTorch's (`one_shot_all_reduce_copy`, "torch"); and an
all-reduce followed by the residual add and RMSNorm of a decoder layer three ways: NCCL then the norm
kernel ("nccl+norm"), the engine's all-reduce then the norm kernel ("symm+norm"), and the engine's
fused kernel ("fused"), which must equal "nccl+norm" exactly. Sizes are
the decode steps' all-reduces of the Qwen3-8B shape (hidden 4096, bf16) at 1, 16, 64 and 256 sequences.
Prints one JSON line per setting and writes allreduce_check.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_SETTINGS = ("default,NCCL_PROTO=LL,NCCL_PROTO=LL128,NCCL_PROTO=Simple,NCCL_ALGO=Tree,"
                    "NCCL_MIN_NCHANNELS=16,NCCL_MIN_NCHANNELS=32,NCCL_PROTO=LL+NCCL_MIN_NCHANNELS=32")


def rank_main(rank: int, setting: str, port: int, sizes: list[int], repeat: int, queue) -> None:
    import torch
    import torch.distributed as dist

    if setting != "default":
        for item in setting.split("+"):
            name, value = item.split("=", 1)
            os.environ[name] = value
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    result = {"setting": setting, "us": {}}
    modes = ["nccl"]
    # the engine's own settings (REDLINE_TP_AR_PROGRAMS=...) leave NCCL as it is: time the engine's kernels
    engine_setting = setting != "default" and all(item.startswith("REDLINE_") for item in setting.split("+"))
    if engine_setting:
        modes = ["symm", "fused"]
    if setting == "default" or engine_setting:
        import torch.distributed._symmetric_memory as symm_mem

        from engine.layers.fusion import add_rms_norm
        from engine.layers.parallel import OneShotAllReduce
        one_shot = OneShotAllReduce.create(torch.device("cuda", rank), torch.bfloat16, rank, 2)
        torch_buffer = symm_mem.empty(max(sizes) * 4096, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(torch_buffer, dist.group.WORLD.group_name)
        if not engine_setting:
            modes += ["symm", "torch", "nccl+norm", "symm+norm", "fused"]
    if "symm" in modes:  # the engine's kernel must give NCCL's sums exactly (two ranks: one rounding each)
        mismatched = 0
        for tokens in sizes:
            x = torch.randn(tokens, 4096, device="cuda").to(torch.bfloat16) * (rank + 1)
            want = x.clone()
            dist.all_reduce(want)
            mismatched += int((one_shot(x.clone()) != want).sum())
        result["symm_vs_nccl_mismatched"] = mismatched
        mismatched = [0, 0]  # residual, normed rows: the fused kernel against NCCL then the norm kernel
        weight = (torch.rand(4096, device="cuda") + 0.5).to(torch.bfloat16)
        for tokens in sizes:
            x = torch.randn(tokens, 4096, device="cuda").to(torch.bfloat16) * (rank + 1)
            residual = torch.randn(tokens, 4096, device="cuda").to(torch.bfloat16)
            summed = x.clone()
            dist.all_reduce(summed)
            want_out, want_residual = add_rms_norm(summed, residual.clone(), weight, 1e-6)
            out, new_residual = one_shot.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
            mismatched[0] += int((new_residual != want_residual).sum())
            mismatched[1] += int((out != want_out).sum())
        result["fused_vs_nccl_norm_mismatched"] = mismatched
    for mode in modes:
        for tokens in sizes:
            x = torch.zeros(tokens, 4096, dtype=torch.bfloat16, device="cuda")  # sums stay finite
            residual = torch.zeros_like(x)
            weight = torch.ones(4096, dtype=torch.bfloat16, device="cuda")

            def once():
                if mode == "fused":
                    return one_shot.add_rms_norm(x, residual, weight, 1e-6)
                if mode == "symm+norm":
                    return add_rms_norm(one_shot(x), residual, weight, 1e-6)
                if mode == "nccl+norm":
                    dist.all_reduce(x)
                    return add_rms_norm(x, residual, weight, 1e-6)
                if mode == "symm":
                    return one_shot(x)
                if mode == "torch":
                    return torch.ops.symm_mem.one_shot_all_reduce_copy(
                        torch_buffer[:x.numel()], x.view(-1), "sum", dist.group.WORLD.group_name)
                dist.all_reduce(x)
                return x

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    once()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(repeat):
                    once()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            result["us"][f"{mode}/{tokens}"] = round(start.elapsed_time(end) * 1000 / (5 * repeat), 2)
            del graph
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def run_setting(setting: str, port: int, sizes: list[int], repeat: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, setting, port, sizes, repeat, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    for p in procs:
        if p.is_alive():
            p.kill()
    return queue.get(timeout=5) if not queue.empty() else {"setting": setting, "error": "no result"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS)
    parser.add_argument("--sizes", default="1,16,64,256", help="tokens per all-reduce (rows of 4096 bf16)")
    parser.add_argument("--repeat", type=int, default=72, help="all-reduces captured in one graph")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = []
    for i, setting in enumerate(args.settings.split(",")):
        result = run_setting(setting, 29600 + i, sizes, args.repeat)
        print(json.dumps(result), flush=True)
        results.append(result)
    (out / "allreduce_check.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
