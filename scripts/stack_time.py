"""GPU time of the persistent decode kernel alone (engine/kernels/decode_stack.py) on the Qwen3-0.6B shape,
28 layers, context 771, against its phase launches (five a layer) and against a kernel of grid barriers
only (as many as the persistent kernel passes), with CUDA events over back-to-back launches.

    PYTHONPATH=. python3 scripts/stack_time.py [--configs "num_warps=8 spin_load=1"]
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from decode_stack_cases import make_problem  # noqa: E402

from decode_graph_time import compiled_kernels, events_ms  # noqa: E402 (scripts/, this script's folder)

from engine.kernels.decode_stack import DecodeStack, _grid_release, _grid_sync, parse_stack_config  # noqa: E402


@triton.jit
def _barriers_kernel(bar_ptr, count, SPIN_LOAD: tl.constexpr):
    target = 0
    for _ in range(count):
        target += tl.num_programs(0)
        _grid_sync(bar_ptr, target, SPIN_LOAD)
    _grid_release(bar_ptr)


def time_ms(fn, repeats: int = 50) -> float:
    """Milliseconds a call, back to back, after one call outside the timing (compilation)."""
    fn()
    torch.cuda.synchronize()
    return events_ms(fn, repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="")
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    weights, inputs = make_problem(args.layers, 1024, 16, 8, 128, 3072, 256, 771, True, torch.bfloat16, "cuda")
    result = {"gpu": torch.cuda.get_device_name()}
    for text in [""] + args.configs.split():
        config = parse_stack_config(text)
        stack = DecodeStack(weights, 16, 8, 1e-6, 1e-6, 128 ** -0.5, config=config)
        result[text or "default"] = time_ms(lambda: stack(**inputs))
        if not text:
            result["phases"] = time_ms(lambda: stack(**inputs, phases=True), 10)
            programs = stack.programs
    barrier = torch.zeros(2, dtype=torch.int32, device="cuda")
    count = 5 * args.layers - 1
    for spin in (False, True):
        for warps in (8, 16):
            result[f"barriers_only_{count}_spin_load{int(spin)}_w{warps}"] = time_ms(
                lambda: _barriers_kernel[(programs,)](barrier, count, SPIN_LOAD=spin, num_warps=warps,
                                                      launch_cooperative_grid=True))
    result["compiled"] = compiled_kernels("engine.kernels.decode_stack", "_decode_stack_kernel")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
