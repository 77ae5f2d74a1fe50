"""After a tensor-parallel engine fails (rank 1 killed mid-generate), is its GPU memory released?

    [REDLINE_TP_ALL_REDUCE=nccl] python scripts/tp_failure_memory.py     (2 GPUs)

Kills rank 1 at the 20th step, drops the engine, then prints rank 0's memory, the threads still alive
and, for each large tensor still allocated, the chain of objects that holds it; then starts a fresh
engine. Prints one JSON line last. A phase stuck for 90 s dumps every thread's stack and exits.
"""
from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(_name, _value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def holders(obj, depth: int = 5, seen=None) -> list[str]:
    """Type chains of the objects that refer to obj (gc referrers), a few levels up."""
    import types

    seen = seen if seen is not None else {id(obj)}
    chains = []
    for ref in gc.get_referrers(obj):
        if id(ref) in seen or isinstance(ref, types.FrameType) and ref is sys._getframe():
            continue
        seen.add(id(ref))
        name = type(ref).__name__
        if isinstance(ref, dict):
            keys = [k for k, v in ref.items() if v is obj][:2]
            name += f"[{keys}]"
        if isinstance(ref, types.FrameType):
            name += f"({ref.f_code.co_name}:{ref.f_lineno})"
        if depth > 1 and not isinstance(ref, types.ModuleType):
            chains += [f"{name} <- {c}" for c in holders(ref, depth - 1, seen)[:3]] or [name]
        else:
            chains.append(name)
    return chains[:6]


def main() -> None:
    import torch

    from engine import LLM, SamplingParams, bench
    from engine.distributed import RankFailedError

    faulthandler.dump_traceback_later(90, exit=True)
    model = bench.resolve_model("qwen3-0.6b")
    kwargs = dict(load_format="dummy", tensor_parallel_size=2, max_model_len=256, gpu_memory_utilization=0.3)
    result = {"mode": os.environ.get("REDLINE_TP_ALL_REDUCE", "symm")}
    llm = LLM(model, **kwargs)
    result["blocks"] = llm.runner.runner.num_kvcache_blocks if hasattr(llm.runner, "runner") else None
    pid, steps, launch, killed = llm.runner.worker_pids[0], [0], llm.runner.launch, []

    def launch_then_kill(*args):
        steps[0] += 1
        if steps[0] == 20:
            killed.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)
        return launch(*args)

    llm.runner.launch = launch_then_kill
    prompts = [[i % 1000 + 1] * 64 for i in range(8)]
    faulthandler.dump_traceback_later(90, exit=True)
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    except RankFailedError as e:
        result["raised"] = str(e).splitlines()[0]
        result["seconds"] = round(time.monotonic() - killed[0], 2)
    llm.shutdown()
    del llm, launch
    launch_then_kill = None  # noqa: F841 (its closure held the engine's launch method)
    gc.collect()
    torch.cuda.empty_cache()
    result["allocated_mb"] = torch.cuda.memory_allocated() // 2**20
    free, total = torch.cuda.mem_get_info()
    result["used_mb"] = (total - free) // 2**20
    result["threads"] = [t.name for t in threading.enumerate()]
    big = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda and o.numel() > 2**24]
    result["large_tensors"] = [{"shape": list(t.shape), "held_by": holders(t)} for t in big[:4]]
    del big
    print(json.dumps(result), flush=True)
    faulthandler.dump_traceback_later(90, exit=True)
    try:
        fresh = LLM(model, **kwargs)
        outs = fresh.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        result["fresh_tokens"] = sum(len(o.token_ids) for o in outs)
        fresh.shutdown()
    except Exception as e:  # noqa: BLE001 (reported)
        result["fresh_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
