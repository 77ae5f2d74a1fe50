"""fp8 checkpoints on the GPU (run on a GPU machine): the W8A8 kernels (engine/kernels/fp8_gemm.py) against torch's
product of the same fp8 operands over many shapes with NaN-poisoned outputs; the prompt logits of an fp8 checkpoint
within fp8's error of its dequantized bf16 run; decode graphs giving eager's tokens; the KV cache of the Qwen3-8B
shape taking the memory fp8 weights save."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.execution.model_runner import prefill_inputs
from tests.conftest import make_checkpoint
from tests.quant_helpers import quantize_checkpoint

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
# (rows, output parts, K): decode and prefill rows; Qwen3-8B's projections; packed parts and K no multiple of 128
SHAPES = [(m, parts, k) for m in (1, 3, 16, 17, 64, 65, 128, 300, 2048)
          for parts, k in (([4096, 1024, 1024], 4096), ([4096], 4096), ([12288, 12288], 4096), ([4096], 12288),
                           ([200, 72], 136))]


def _poisoned(monkeypatch):
    from engine.kernels import fp8_gemm
    original = torch.empty

    def empty(*shape, **kw):
        return original(*shape, **kw).fill_(float("nan"))
    monkeypatch.setattr(fp8_gemm.torch, "empty", empty)


def _emulated(x, group, w_deq):
    """x's rows quantized as the kernel quantizes them (torch's fp8 cast), times the dequantized weight, in fp32."""
    k = x.shape[1]
    scale = torch.stack([x[:, i:i + group].float().abs().amax(1) / 448 for i in range(0, k, group)], 1)
    scale = scale.clamp(min=1e-12).repeat_interleave(group, 1)[:, :k]
    return ((x.float() / scale).clamp(-448, 448).to(FP8).float() * scale) @ w_deq.T


@pytest.mark.parametrize("rows,parts,k", SHAPES, ids=[f"m{m}-n{'+'.join(map(str, p))}-k{k}" for m, p, k in SHAPES])
@pytest.mark.parametrize("blockwise", [True, False], ids=["block", "channel"])
def test_w8a8_gemm_equals_torch_on_the_same_fp8_operands(rows, parts, k, blockwise, monkeypatch):
    from engine.kernels import fp8_gemm

    torch.manual_seed(rows + k)
    n = sum(parts)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 100).to(FP8)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if rows % 2 else None
    _poisoned(monkeypatch)
    if blockwise:
        rows_of, first = [], 0
        for size in parts:
            rows_of.append(first + torch.arange(size, device="cuda") // 128)
            first += -(-size // 128)
        scale_row = torch.cat(rows_of).to(torch.int32)
        w_scale = torch.rand(first, -(-k // 128), device="cuda") * 1e-3 + 1e-4
        w_deq = w.float() * w_scale[scale_row.long()].repeat_interleave(128, 1)[:, :k]
        out = fp8_gemm.fp8_block_linear(x, w, w_scale, scale_row, 128, bias)
        want = _emulated(x, 128, w_deq)
    else:
        ch = torch.rand(n, device="cuda") * 1e-3 + 1e-4
        w_deq = w.float() * ch[:, None]
        out = fp8_gemm.fp8_channel_linear(x, w, ch, bias)
        want = _emulated(x, k, w_deq)
    if bias is not None:
        want = want + bias.float()
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    rel = float((out.float() - want).norm() / want.norm())
    assert rel < 1e-2, rel


def test_static_input_scale_quantizes_every_row_by_it(monkeypatch):
    from engine.kernels import fp8_gemm

    x = torch.randn(40, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 512, device="cuda").to(FP8)
    ch = torch.rand(256, device="cuda") + 0.5
    scale = torch.tensor([0.02], device="cuda")
    _poisoned(monkeypatch)
    out = fp8_gemm.fp8_channel_linear(x, w, ch, None, scale)
    want = ((x.float() / scale).clamp(-448, 448).to(FP8).float() * scale) @ (w.float() * ch[:, None]).T
    assert float((out.float() - want).norm() / want.norm()) < 1e-2


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory) -> dict:
    """A Qwen3 checkpoint of real head sizes written by transformers, in block-wise and compressed-tensors
    per-channel fp8, with the dequantized references."""
    base = make_checkpoint("qwen3", tmp_path_factory.mktemp("gpu-fp8"), hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                           initializer_range=0.05)
    out = {}
    for fmt in ("fp8-block", "ct-fp8-channel"):
        model_dir = tmp_path_factory.mktemp(fmt) / fmt
        out[fmt] = (model_dir, quantize_checkpoint(base, model_dir, fmt))
    return out


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(8, 300))] for _ in range(n)]


def _prompt_logits(llm, prompt):
    runner = llm.runner
    inputs = prefill_inputs([prompt], runner.block_size, -(-len(prompt) // runner.block_size))
    inputs.logits_indices = torch.arange(len(prompt))
    with torch.inference_mode():
        return runner.compute_logits(runner.forward(inputs), inputs).float()


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-fp8-channel"])
def test_prompt_logits_are_within_fp8_activation_error_of_the_dequantized_bf16_run(fp8_checkpoints, fmt, free_gpu):
    """Only the activations' fp8 rounding separates the two runs (the weights are the same values): a few
    percent of the logits' norm, and the same top token almost everywhere."""
    model_dir, reference = fp8_checkpoints[fmt]
    quantized = LLM(str(model_dir), dtype="bfloat16", enforce_eager=True, num_kvcache_blocks=64)
    ours = [_prompt_logits(quantized, p) for p in _prompts(4, 1)]
    quantized.shutdown()
    dequantized = LLM(str(reference), dtype="bfloat16", enforce_eager=True, num_kvcache_blocks=64)
    ref = [_prompt_logits(dequantized, p) for p in _prompts(4, 1)]
    dequantized.shutdown()
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(ours, ref)]
    same_top = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, ref))
    total = sum(len(p) for p in _prompts(4, 1))
    print(f"{fmt}: relative logit error {errors}, same top token {same_top}/{total}")
    assert max(errors) < 0.08 and same_top >= 0.9 * total


def test_decode_graphs_give_the_eager_tokens(fp8_checkpoints, free_gpu):
    model_dir, _ = fp8_checkpoints["fp8-block"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(8, 2)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(model_dir), dtype="bfloat16", enforce_eager=eager, num_kvcache_blocks=128)
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    same = sum(a == b for a, b in zip(outs[True], outs[False]))
    assert same >= len(prompts) - 1, (outs[True], outs[False])


def test_the_8b_shape_in_fp8_gives_its_kv_cache_the_memory_its_weights_save(free_gpu):
    """Qwen3-8B's linears hold ~6.9e9 weights: in fp8 the KV cache gains about 6.9 GB (at least 5 GB)."""
    from engine.builtin import BUILTIN_MODELS
    from worker.bench_engine import BENCH_QUANTIZATIONS, quantized_shape

    sizes = {}
    for name, model in (("bf16", "qwen3-8b"), ("fp8", quantized_shape(BUILTIN_MODELS["qwen3-8b"],
                                                                        BENCH_QUANTIZATIONS["fp8"]))):
        llm = LLM(model, load_format="dummy", enforce_eager=True, max_model_len=4096)
        runner = llm.runner
        sizes[name] = runner.num_kvcache_blocks * runner._kv_bytes_per_block()
        llm.shutdown()
    print(f"KV cache bytes: {sizes}")
    assert sizes["fp8"] - sizes["bf16"] > 5e9
