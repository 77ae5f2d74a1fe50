"""Cases for the int4 kernels (engine/kernels/int4_gemm.py) under the Triton interpreter, each against the
dequantized weight in torch (engine/layers/quant/int4.py dequantize), into NaN-poisoned outputs. Run by
tests/test_quant_int4.py with TRITON_INTERPRET=1. Prints one JSON object: {case: outcome}.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels import int4_gemm  # noqa: E402
from engine.layers.quant.int4 import dequantize, pack_int4  # noqa: E402


def weights(k: int, n: int, group: int, seed: int, scale_dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    return pack_int4(q, 0), scales, zeros


def case(rows: int, k: int, n: int, group: int, dtype=torch.float32, bias: bool = False, seed: int = 0) -> dict:
    qweight, scales, zeros = weights(k, n, group, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    want = x.float() @ dequantize(qweight, scales, zeros, dtype).float()
    if b is not None:
        want += b.float()
    out = torch.full((rows + 3, n), float("nan"), dtype=dtype)
    got = int4_gemm.int4_linear(x, qweight, scales, zeros, group, b, out=out[:rows])
    err = (got.float() - want).abs().max().item() if rows else 0.0
    scale = want.abs().max().item() if rows else 1.0
    return {"relative_error": err / max(scale, 1e-6), "unwritten": int(torch.isnan(out[:rows]).any(1).sum()),
            "tail_untouched": bool(torch.isnan(out[rows:]).all()), "same_storage": got.data_ptr() == out.data_ptr()}


def case_engine(fmt: str) -> dict:
    """A tiny Qwen3 in `fmt` through the engine with every quantized projection on the int4 kernels (as on CUDA),
    against transformers on the dequantized weights."""
    import tempfile

    from engine import LLM, SamplingParams
    from engine.layers.quant import int4
    from tests.conftest import hf_greedy, make_checkpoint
    from tests.quant_helpers import quantize_checkpoint

    calls = []

    def kernels(x, weight, name):
        calls.append(x.shape[0])
        return int4_gemm

    prompts = [[5, 17, 230, 41, 9], list(range(20, 60)), [300, 12, 77]]
    with tempfile.TemporaryDirectory() as tmp:
        base = make_checkpoint("qwen3", Path(tmp) / "float")
        reference = quantize_checkpoint(base, Path(tmp) / fmt, fmt)
        expected = hf_greedy(reference, prompts, 8)
        int4._kernels_for = kernels
        llm = LLM(str(Path(tmp) / fmt), device="cpu", dtype="float32", kvcache_block_size=8)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return {"equal": [o.token_ids for o in outs] == expected, "gemv_calls": sum(r <= 16 for r in calls),
            "gemm_calls": sum(r > 16 for r in calls)}


CASES = {
    "gemv_one_row": lambda: case(1, 256, 96, 128),
    "gemv_three_rows_bias": lambda: case(3, 256, 72, 128, bias=True),
    "gemv_sixteen_rows_small_groups": lambda: case(16, 192, 40, 32),
    "gemv_per_channel": lambda: case(2, 96, 48, 96),
    "gemv_unsplit_bias": lambda: case(2, 128, 288, 32, bias=True),  # enough columns: one slice of K, no sum kernel
    "gemm_seventeen_rows": lambda: case(17, 256, 72, 128, bias=True),
    "gemm_ragged_rows_small_groups": lambda: case(45, 160, 56, 32),
    "gemv_bf16": lambda: case(4, 256, 64, 128, dtype=torch.bfloat16),
    "gemv_one_row_bf16": lambda: case(1, 512, 64, 128, dtype=torch.bfloat16),
    "gemv_eight_rows_bf16": lambda: case(8, 256, 64, 32, dtype=torch.bfloat16, bias=True),
    "gemm_bf16": lambda: case(33, 256, 64, 128, dtype=torch.bfloat16),
    "no_rows": lambda: case(0, 128, 32, 128),
    "engine_gptq_desc_act": lambda: case_engine("gptq-desc-act"),
    "engine_awq": lambda: case_engine("awq"),
}


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    print(json.dumps({name: CASES[name]() for name in names}))


if __name__ == "__main__":
    main()
