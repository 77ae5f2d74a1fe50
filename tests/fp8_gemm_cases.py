"""The fp8 GEMM kernels (engine/kernels/fp8_gemm.py) under the Triton interpreter, against torch; with arguments,
the engine end to end on those kernels (as on CUDA) for the named compressed-tensors formats, against transformers
running the same checkpoint through the compressed-tensors library, which quantizes the activations as the kernels
do (per token, or per group of 128 for blocks). Prints one JSON object of results (run by tests/test_quant_fp8.py
through tests/interpreter.py)."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from engine.kernels import fp8_gemm

FP8 = torch.float8_e4m3fn


def quantize_case(rows: int, k: int, group: int | None) -> dict:
    """quantize_rows: each group's scale is amax / 448 and its fp8 values torch's cast of x / scale (rounded to
    nearest even, subnormals included: one row is tiny but for one element)."""
    x = torch.randn(rows, k) * torch.linspace(0.1, 10, rows)[:, None]
    x[-1] *= 1e-4
    x[-1, 1] = 5.0
    q, scales = fp8_gemm.quantize_rows(x, group)
    g = group or k
    want = torch.stack([x[:, i:i + g].abs().amax(1) / 448 for i in range(0, k, g)], 1)
    expanded = scales.repeat_interleave(g, 1)[:, :k]
    torch_q = (x / expanded).clamp(-448, 448).to(FP8)
    return {"scale_err": ((scales - want).abs() / want).max().item(),
            "values_differing": int((q.float() != torch_q.float()).sum()), "shape": list(scales.shape)}


def gemm_case(m: int, parts: list[int], k: int, blockwise: bool, bias: bool, static: bool = False) -> dict:
    """_gemm of fp8 operands with their scales against the float32 product of the dequantized operands; the output
    starts NaN-poisoned (every element must be written)."""
    n = sum(parts)
    a = (torch.randn(m, k) * 3).to(FP8)
    w = (torch.randn(n, k) * 3).to(FP8)
    b = torch.randn(n) if bias else None
    if blockwise:
        rows, first = [], 0
        for size in parts:  # each packed part with its own 128-row blocks
            rows.append(first + torch.arange(size) // 128)
            first += -(-size // 128)
        scale_row = torch.cat(rows).to(torch.int32)
        a_scale = torch.rand(m, -(-k // 128)) + 0.5
        w_scale = torch.rand(first, -(-k // 128)) + 0.5
        a_deq = a.float() * a_scale.repeat_interleave(128, 1)[:, :k]
        w_deq = w.float() * w_scale[scale_row.long()].repeat_interleave(128, 1)[:, :k]
    else:
        scale_row = None
        a_scale = torch.tensor([[0.7]]).expand(m, 1) if static else torch.rand(m, 1) + 0.5
        w_scale = torch.rand(n) + 0.5
        a_deq, w_deq = a.float() * a_scale, w.float() * w_scale[:, None]
    want = a_deq @ w_deq.T + (b if bias else 0)
    original = torch.empty
    torch.empty = lambda *s, **kw: original(*s, **kw).fill_(float("nan"))  # poisoned outputs
    try:
        out = fp8_gemm._gemm(a, a_scale, w, w_scale, scale_row, b, torch.float32, 128)
    finally:
        torch.empty = original
    return {"rel_err": ((out - want).abs().max() / want.abs().max()).item(), "nan": bool(out.isnan().any())}


def linear_case(m: int, n: int, k: int, blockwise: bool, dtype: torch.dtype) -> dict:
    """The whole product (activation quantization, GEMM) against the dequantized weight's product in float32:
    the error is the activations' fp8 rounding (a few percent of the output's scale at most)."""
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k) * 0.05
    if blockwise:
        w_scale = torch.rand(-(-n // 128), -(-k // 128)) * 0.01 + 0.001
        scale_row = (torch.arange(n) // 128).to(torch.int32)
        w_q = (w / w_scale[scale_row.long()].repeat_interleave(128, 1)[:, :k]).clamp(-448, 448).to(FP8)
        w_deq = w_q.float() * w_scale[scale_row.long()].repeat_interleave(128, 1)[:, :k]
        out = fp8_gemm.fp8_block_linear(x, w_q, w_scale, scale_row, 128)
    else:
        ch = w.abs().amax(1) / 448
        w_q = (w / ch[:, None]).to(FP8)
        w_deq = w_q.float() * ch[:, None]
        out = fp8_gemm.fp8_channel_linear(x, w_q, ch)
    want = x.float() @ w_deq.T
    group = 128 if blockwise else k  # the activations as the kernel quantizes them, in torch
    x_scale = torch.stack([x[:, i:i + group].float().abs().amax(1) / 448 for i in range(0, k, group)], 1)
    x_scale = x_scale.repeat_interleave(group, 1)[:, :k]
    x_deq = (x.float() / x_scale).clamp(-448, 448).to(FP8).float() * x_scale
    emulated = (x_deq @ w_deq.T).to(dtype).float()
    return {"rel_err": ((out.float() - want).abs().max() / want.abs().max()).item(),
            "emulated_rel_err": ((out.float() - emulated).abs().max() / emulated.abs().max()).item(),
            "dtype": str(out.dtype)}


def engine_case(fmt: str) -> dict:
    """Greedy tokens of the engine with its fp8 projections on the kernels, and of transformers (compressed-tensors'
    forward) on the same checkpoint; block-wise: every projection a whole number of 128-blocks, as that library
    needs."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.layers.quant import fp8
    from tests.conftest import make_checkpoint
    from tests.quant_helpers import quantize_checkpoint

    calls = []
    fp8._kernels_for = lambda x: calls.append(x.shape[0]) or fp8_gemm
    shape = dict(hidden_size=256, intermediate_size=384, head_dim=64) if "block" in fmt else dict(intermediate_size=192)
    prompts = [[5, 17, 33, 9, 100], [7, 8, 9, 10, 11, 12, 13], [300, 2, 41]]  # the dequantized path gives others
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / fmt
        quantize_checkpoint(make_checkpoint("qwen3", Path(tmp) / "float", **shape), model_dir, fmt)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        want = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                     pad_token_id=0)
                want.append(out[0, len(p):].tolist())
        llm = LLM(str(model_dir), device="cpu", max_model_len=64)
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
    return {"equal": got == want, "kernel_calls": len(calls)}


def main() -> None:
    if sys.argv[1:]:
        print(json.dumps({fmt: engine_case(fmt) for fmt in sys.argv[1:]}))
        return
    torch.manual_seed(0)
    results = {
        "quantize_group_128": quantize_case(5, 300, 128),
        "quantize_row": quantize_case(3, 200, None),
        # decode rows, a packed qkv whose parts are no multiple of 128, K not a multiple of 128
        "block_decode_packed": gemm_case(3, [192, 64, 64], 200, True, False),
        "block_prefill_bias": gemm_case(130, [256], 384, True, True),
        "block_mid_rows": gemm_case(40, [128, 96], 256, True, False),
        "channel_decode": gemm_case(1, [96], 136, False, False),
        "channel_prefill_bias": gemm_case(150, [200], 256, False, True),
        "channel_static": gemm_case(20, [64], 128, False, False, static=True),
        "linear_block_fp32": linear_case(6, 256, 384, True, torch.float32),
        "linear_block_bf16": linear_case(33, 128, 256, True, torch.bfloat16),
        "linear_channel_fp32": linear_case(17, 192, 256, False, torch.float32),
        "no_rows": {"shape": list(fp8_gemm.fp8_channel_linear(torch.randn(0, 64), torch.zeros(32, 64, dtype=FP8),
                                                              torch.ones(32)).shape)},
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
