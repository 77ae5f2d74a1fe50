"""Host time per step of the tensor-parallel path on CPU (gloo): TP=1 vs TP=2, and where TP=2's time goes.

    python scripts/tp_overhead.py [--num-prompts 64] [--max-new 200] [--async-scheduling 0|1]

Decode-heavy workload on the built-in tiny model with dummy weights. Prints, per size, the mean time of a
step and, at TP=2, the mean time per step spent in each part of rank 0's step (measured by wrapping the
driver's pieces, so the parts add a little time of their own).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed(table: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name] += time.perf_counter() - start
    return wrapper


def run(size: int, args) -> dict:
    from engine import LLM, SamplingParams
    from engine.builtin import TINY_MODEL_DIR

    import torch
    if size == 1:  # the TP=2 ranks get one core each: give TP=1 one too, so only the TP path differs
        torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    llm = LLM(TINY_MODEL_DIR, load_format="dummy", device="cpu", tensor_parallel_size=size,
              async_scheduling=bool(args.async_scheduling), max_model_len=512)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(8, 32))] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_new, ignore_eos=True)
    parts: dict[str, float] = defaultdict(float)
    try:
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        if size > 1:
            from engine import distributed
            runner, workers = llm.runner, llm.runner._workers
            distributed._to_wire = _timed(parts, "to_wire", distributed._to_wire)
            workers.send = _timed(parts, "send (pickle + pipe write)", workers.send)
            name = "collect_acks" if hasattr(workers, "collect_acks") else "collect"
            setattr(workers, name, _timed(parts, "ack wait", getattr(workers, name)))
            import torch.distributed as dist
            for name in ("all_reduce", "all_gather", "broadcast"):
                setattr(dist, name, _timed(parts, "collectives (in forward/logits)", getattr(dist, name)))
            runner.runner.forward = _timed(parts, "rank 0 forward", runner.runner.forward)
            runner.runner.compute_logits = _timed(parts, "rank 0 logits (all-gather)", runner.runner.compute_logits)
        else:
            llm.runner.forward = _timed(parts, "forward", llm.runner.forward)
            llm.runner.compute_logits = _timed(parts, "logits", llm.runner.compute_logits)
        prepare = llm.runner.prepare_inputs
        last_inputs = []

        def keep_last(batch):
            inputs = prepare(batch)
            if len(inputs.input_ids) == args.num_prompts:  # a full decode step
                last_inputs[:] = [inputs]
            return inputs

        llm.runner.prepare_inputs = _timed(parts, "prepare_inputs", keep_last)
        steps = 0
        step = llm.step
        for prompt in prompts:
            llm.add_request(prompt, params)
        start = time.perf_counter()
        while llm.has_unfinished():
            step(finished_only=True)
            steps += 1
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    per_step_ms = {k: round(v / steps * 1e3, 3) for k, v in sorted(parts.items())}
    if size > 1 and last_inputs:
        per_step_ms["pipe round trip, no forward"] = pipe_round_trip_ms(last_inputs[0])
    return {"tp": size, "async": bool(args.async_scheduling), "steps": steps, "seconds": round(elapsed, 2),
            "ms_per_step": round(elapsed / steps * 1e3, 3), "parts_ms_per_step": per_step_ms}


def _echo(conn) -> None:
    from engine.distributed import _from_wire
    while (message := conn.recv()) is not None:
        _from_wire(message[1])
        conn.send(("ok",))


def pipe_round_trip_ms(inputs, repeats: int = 2000) -> float:
    """One decode step's command through a pipe to another process and its acknowledgement back, as the
    driver sends it (to_wire, pickle, write; the peer reads, unpickles, rebuilds the tensors, answers)."""
    from multiprocessing import get_context

    from engine.distributed import _to_wire
    ctx = get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=_echo, args=(child,), daemon=True)
    peer.start()
    for _ in range(50):
        parent.send(("execute", _to_wire(inputs), True))
        parent.recv()
    start = time.perf_counter()
    for _ in range(repeats):
        parent.send(("execute", _to_wire(inputs), True))
        parent.recv()
    elapsed = time.perf_counter() - start
    parent.send(None)
    peer.join()
    return round(elapsed / repeats * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new", type=int, default=200)
    parser.add_argument("--async-scheduling", type=int, default=0)
    parser.add_argument("--sizes", default="1,2")
    args = parser.parse_args()
    for size in (int(s) for s in args.sizes.split(",")):
        print(json.dumps(run(size, args)), flush=True)


if __name__ == "__main__":
    main()
