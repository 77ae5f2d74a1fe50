"""The LoRA shrink/expand kernels (engine/kernels/lora.py) against the torch products, under the Triton
interpreter (tests/lora_cases.py: alone, and in a CPU engine whose LoRA projections call them as on CUDA) and,
marked gpu, compiled on a GPU."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.interpreter import run_under_interpreter

CASES = Path(__file__).with_name("lora_cases.py")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
TOLERANCE = {"decode_fp32": 1e-5, "prefill_fp32": 1e-5, "padded_tiles_fp32": 1e-5, "decode_bf16": 2e-2,
             "split_k_fp32": 1e-5, "norm_fp32": 1e-5, "unit_norm_bf16": 2e-2, "silu_and_mul_fp32": 1e-5}
# each case's (rows, k, n, w, slots), whether its tiles are padded as a decode graph's, and its prologue
SHAPES = {"decode_fp32": ((7, 64, 96, 16, 3), False, None), "prefill_fp32": ((45, 64, 80, 48, 4), False, None),
          "padded_tiles_fp32": ((20, 32, 64, 16, 2), True, None), "decode_bf16": ((9, 128, 192, 64, 4), False, None),
          "split_k_fp32": ((21, 1000, 64, 32, 3), True, None), "norm_fp32": ((19, 600, 64, 48, 3), True, "norm"),
          "unit_norm_bf16": ((11, 512, 128, 32, 2), False, "unit_norm"),
          "silu_and_mul_fp32": ((17, 520, 80, 16, 3), False, "silu_and_mul")}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_under_interpreter(CASES)


@pytest.mark.parametrize("case", sorted(TOLERANCE))
def test_each_row_gets_its_slots_product_and_base_rows_none(results, case):
    assert results[case]["relative_error"] <= TOLERANCE[case]
    assert results[case]["base_rows_changed"] == 0


def test_an_engine_whose_lora_projections_run_the_kernels_gives_the_torch_paths_tokens(results):
    outcome = results["engine_on_kernels"]
    # qkv and gate/up take their norms in the shrink, down its SiLU x up, o_proj its input as it is
    assert outcome["adapters_change_tokens"] and set(outcome["kernel_calls"]) == {"norm", "silu_and_mul", "plain"}
    assert outcome["tokens_equal"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(TOLERANCE))
def test_compiled_kernels_on_gpu_match_torch(case):
    import sys

    sys.path.insert(0, str(CASES.parent))
    import lora_cases

    f32 = "fp32" in case
    import torch

    args, pad, prologue = SHAPES[case]
    got = lora_cases.case(*args, torch.float32 if f32 else torch.bfloat16, "cuda", pad=pad, prologue=prologue)
    assert got["relative_error"] <= (1e-3 if f32 else 2e-2)  # tf32-free fp32 dots; bf16 operands
    assert got["base_rows_changed"] == 0
