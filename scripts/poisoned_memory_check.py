"""Tokens of an engine whose allocations reuse memory that earlier work left full of bytes, against a clean one.

    PYTHONPATH=. python3 scripts/poisoned_memory_check.py [--poison 255,60,random]

A long-lived worker never starts on zeroed memory: the caching allocator hands the engine blocks that
earlier tensors filled. A read of a buffer before anything wrote it gives the same tokens on a fresh
process (the driver zeroes new memory) and different ones after other work. For each byte value
(`random`: random bytes), this fills and frees GPU memory, builds an engine (eager, then CUDA graphs) on a
tiny random checkpoint, and compares its tokens, sampled and greedy, with those of the clean eager engine.
Prints one line per run and where the first difference is. The engine's KV sizing returns the allocator's
cache to the driver before it allocates, so the poisoned pages may not all come back to it.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import LLM, SamplingParams  # noqa: E402
from tests.conftest import make_checkpoint  # noqa: E402
from tests.test_gpu_engine import _prompts  # noqa: E402  (the GPU tests' prompts)


def poison(value: str, gib: float) -> None:
    """Fill `gib` GiB of fresh device memory with `value` and free it into the caching allocator."""
    block = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    if value == "random":
        block.random_(0, 256)
    else:
        block.fill_(int(value))
    torch.cuda.synchronize()
    del block


def tokens(checkpoint: Path, eager: bool, runs) -> list:
    llm = LLM(str(checkpoint), device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=4,
              enforce_eager=eager)
    out = [[(o.token_ids, [round(lp["logprob"], 3) for lp in o.logprobs or []])
            for o in llm.generate(p, sp, use_tqdm=False)] for p, sp in runs]
    llm.shutdown()
    del llm
    gc.collect()
    return out


def first_difference(a: list, b: list) -> str:
    for r, (ra, rb) in enumerate(zip(a, b)):
        for s, (sa, sb) in enumerate(zip(ra, rb)):
            if sa != sb:
                at = next((i for i, (x, y) in enumerate(zip(sa[0], sb[0])) if x != y), None)
                return f"run {r} sequence {s} token {at}: {sa[0][at:at + 4] if at is not None else sa} / " \
                       f"{sb[0][at:at + 4] if at is not None else sb}"
    return "none"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--poison", default="255,60,random")
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--max-new", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_checkpoint("qwen3", Path(tmp), hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                     initializer_range=0.05, head_dim=128, num_attention_heads=8,
                                     num_key_value_heads=8)
        ps = _prompts(4, 9)
        runs = [(ps[:1], SamplingParams(temperature=0.8, max_tokens=args.max_new)),
                (ps, SamplingParams(temperature=0.8, max_tokens=args.max_new)),
                (ps, SamplingParams(temperature=0, max_tokens=args.max_new))]
        clean = tokens(checkpoint, True, runs)
        print("clean graphs:", first_difference(clean, tokens(checkpoint, False, runs)), flush=True)
        for value in args.poison.split(","):
            for eager in (True, False):
                poison(value, args.gib)
                got = tokens(checkpoint, eager, runs)
                torch.cuda.empty_cache()
                print(f"poison {value} {'eager' if eager else 'graphs'}:", first_difference(clean, got), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
