"""Quantizers that write tiny checkpoints in published quantized formats, with their float references.

`quantize_checkpoint(src, out, fmt)` reads a float checkpoint written by transformers (tests/conftest.py's
make_checkpoint), quantizes the decoder's linear weights the way `fmt` publishes them (tensor names, dtypes,
shapes, config.json's `quantization_config`), and writes beside it a plain float checkpoint of the dequantized
weights: transformers runs that one, and the engine must give its tokens on the quantized one.

A format is a Format: its `quantization_config` (given the ignored modules) and `quantize(weight)` → (the
tensors that replace `<module>.weight`, by suffix; the dequantized weight). Add a format to FORMATS.
"""
from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# the decoder's linear layers: what the published checkpoints quantize (never embeddings, norms or lm_head)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Format:
    quantization_config: Callable[[list[str]], dict]  # ignored module names → config.json's quantization_config
    quantize: Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale per block [ceil(N / bn), ceil(K / bk)], dequantized weight): scale = amax / 448."""
    bn, bk = block
    n, k = weight.shape
    w = weight.float()
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w
    tiles = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    expanded = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    q = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale, q.float() * expanded


def fp8_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale per output channel [N, 1], dequantized weight)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale, q.float() * scale


def fp8_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale of the tensor (0-dim), dequantized weight)."""
    w = weight.float()
    scale = (w.abs().max() / FP8_MAX).clamp(min=1e-12)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale, q.float() * scale


def fp8_block_format(block: tuple[int, int] = (128, 128)) -> Format:
    """Qwen3-*-FP8 / DeepSeek: `weight` fp8, `weight_scale_inv` float32 per block, dynamic activations."""
    def quantize(weight):
        q, scale, deq = fp8_blocks(weight, block)
        return {"weight": q, "weight_scale_inv": scale}, deq
    return Format(lambda ignore: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": ignore or None},
                  quantize)


def fp8_tensor_format(static_input_scale: float | None = None) -> Format:
    """Per-tensor fp8 (vLLM's / AutoFP8's): `weight_scale` scalar; with a static scheme an `input_scale` scalar."""
    def quantize(weight):
        q, scale, deq = fp8_tensor(weight)
        tensors = {"weight": q, "weight_scale": scale}
        if static_input_scale is not None:
            tensors["input_scale"] = torch.tensor(static_input_scale)
        return tensors, deq
    scheme = "dynamic" if static_input_scale is None else "static"
    return Format(lambda ignore: {"quant_method": "fp8", "activation_scheme": scheme,
                                  "modules_to_not_convert": ignore or None}, quantize)


def compressed_tensors_fp8_format(strategy: str, static_input_scale: float | None = None, block: int = 128) -> Format:
    """compressed-tensors float-quantized fp8 (RedHat/neuralmagic): `weight` fp8, `weight_scale` [N, 1] (channel),
    [1] (tensor) or per block of block x block (block, with activations dynamic per group of `block`); dynamic
    per-token activations, or a static per-tensor `input_scale` [1]; lm_head ignored."""
    def quantize(weight):
        if strategy == "channel":
            q, scale, deq = fp8_channels(weight)
        elif strategy == "block":
            q, scale, deq = fp8_blocks(weight, (block, block))
        else:
            q, scale, deq = fp8_tensor(weight)
            scale = scale.reshape(1)
        tensors = {"weight": q, "weight_scale": scale}
        if static_input_scale is not None:
            tensors["input_scale"] = torch.tensor([static_input_scale])
        return tensors, deq

    def config(ignore):
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
                   "group_size": None, "block_structure": [block, block] if strategy == "block" else None,
                   "actorder": None, "observer": "minmax"}
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True,
                  "group_size": None, "observer": None}
        if strategy == "block":
            inputs.update(strategy="group", group_size=block)
        if static_input_scale is not None:
            inputs.update(strategy="tensor", dynamic=False, observer="minmax")
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                              "output_activations": None}},
                "ignore": ["lm_head", *ignore], "kv_cache_scheme": None}
    return Format(config, quantize)


FORMATS: dict[str, Callable[[], Format]] = {
    "fp8-block": fp8_block_format,
    "fp8-block-16": lambda: fp8_block_format((16, 16)),  # blocks small enough to split a tiny model over 2 ranks
    "fp8-tensor": fp8_tensor_format,
    "fp8-tensor-static": lambda: fp8_tensor_format(static_input_scale=0.05),
    "ct-fp8-channel": lambda: compressed_tensors_fp8_format("channel"),
    "ct-fp8-tensor": lambda: compressed_tensors_fp8_format("tensor"),
    "ct-fp8-tensor-static": lambda: compressed_tensors_fp8_format("tensor", static_input_scale=0.05),
    "ct-fp8-block": lambda: compressed_tensors_fp8_format("block"),
}


def quantize_checkpoint(src: Path, out: Path, fmt: str | Format, ignore: tuple[str, ...] = ()) -> Path:
    """Write `src` quantized in `fmt` to `out` (the other files copied), and the dequantized float checkpoint to
    `out`-dequantized; returns that reference's directory. ignore: module names left in float (as the format's
    config names them)."""
    form = FORMATS[fmt]() if isinstance(fmt, str) else fmt

    def convert(name: str, tensor: torch.Tensor):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in LINEAR_NAMES \
                or any(module == i or module.endswith("." + i) for i in ignore):
            return None
        tensors, deq = form.quantize(tensor)
        return {f"{module}.{suffix}": t.contiguous() for suffix, t in tensors.items()}, deq.to(tensor.dtype)

    return _write_quantized(src, out, convert, form.quantization_config(list(ignore)))


def _write_quantized(src: Path, out: Path, convert: Callable, quantization_config: dict) -> Path:
    """`src`'s files copied to `out` and `out`-dequantized; each tensor that convert(name, tensor) turns into
    (quantized tensors by name, dequantized tensor) written so, the others as they are; `out`'s config given
    quantization_config. Returns the dequantized checkpoint's directory."""
    out, reference = Path(out), Path(str(out) + "-dequantized")
    for target in (out, reference):
        shutil.copytree(src, target, dirs_exist_ok=True)
        for f in target.glob("*.safetensors"):
            f.unlink()
    quantized, dequantized = {}, {}
    for file in sorted(Path(src).glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            converted = convert(name, tensor)
            if converted is None:
                quantized[name] = dequantized[name] = tensor
            else:
                tensors, dequantized[name] = converted
                quantized.update(tensors)
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return reference


# ---- int4: AWQ (gemm), GPTQ, compressed-tensors pack-quantized -------------------------------------------

def int4_groups(weight: torch.Tensor, group_size: int, sym: bool, order: torch.Tensor):
    """(q uint8 [N, K] in 0..15, zeros uint8 [K / G, N], fp16 scales [K / G, N]) of a float weight [N, K], its
    input features grouped in `order` (group i: features order[i * G:(i + 1) * G]): min/max per group, or
    symmetric (every zero 8). W ~ (q - zero) * scale."""
    n, k = weight.shape
    grouped = weight[:, order].float().reshape(n, k // group_size, group_size)
    if sym:
        scales = (grouped.abs().amax(-1) / 7.5).clamp(min=1e-5)
        zeros = torch.full_like(scales, 8)
    else:
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scales = ((high - low) / 15).clamp(min=1e-5)
        zeros = (-low / scales).round().clamp(0, 15)
    scales = scales.half()
    q = ((grouped / scales.float()[..., None]).round() + zeros[..., None]).clamp(0, 15).reshape(n, k)
    q = q[:, torch.argsort(order)]  # back to the features' own order
    return q.to(torch.uint8), zeros.to(torch.uint8).t().contiguous(), scales.t().contiguous()


def int4_format(fmt: str, group_size: int = 32, sym: bool = False, desc_act: bool = False, seed: int = 0,
                gptq_v2: bool = False) -> Format:
    """fmt "awq" (AutoAWQ gemm: qweight [K, N/8] and qzeros packed along N in AWQ's order, fp16 scales),
    "gptq" (qweight [K/8, N], qzeros [K/G, N/8] stored minus one as the original format does (gptq_v2: as they
    are), scales, g_idx;
    desc_act: input features grouped in a random order, one per input size, as GPTQ's act order is one for
    the projections of one input) or "compressed-tensors"
    (pack-quantized: weight_packed [N, K/8] of q + 8 signed, weight_scale [N, K/G], weight_zero_point
    [N/8, K/G] when asymmetric, weight_shape)."""
    from engine.layers.quant.int4 import awq_pack, pack_int4

    gen = torch.Generator().manual_seed(seed)
    orders = {}  # by input features: projections of one input (q, k, v; gate, up) share GPTQ's act order

    def quantize(weight):
        n, k = weight.shape
        group = k if group_size == -1 else group_size  # -1: one group per output channel
        order = orders.setdefault(k, torch.randperm(k, generator=gen)) if desc_act else torch.arange(k)
        q, zeros, scales = int4_groups(weight, group, sym, order)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // group).to(torch.int32)
        read_zeros = zeros.int()
        if fmt == "awq":
            tensors = {"qweight": awq_pack(q.t()), "qzeros": awq_pack(zeros), "scales": scales}
        elif fmt == "gptq":
            stored = zeros.int() if gptq_v2 else (zeros.int() - 1) & 0xF
            read_zeros = stored if gptq_v2 else stored + 1  # v1: a zero of 0 reads back as 16, as its kernels read it
            tensors = {"qweight": pack_int4(q.t(), 0), "qzeros": pack_int4(stored, 1), "scales": scales,
                       "g_idx": g_idx}
        else:
            tensors = {"weight_packed": pack_int4(q, 1), "weight_scale": scales.t(),
                       "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
            if not sym:
                tensors["weight_zero_point"] = pack_int4(zeros.t(), 0)
        group = g_idx.long()
        deq = (q.float().t() - read_zeros.float()[group]) * scales.float()[group]
        return tensors, deq.t()

    def config(ignore):
        if fmt == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": ignore or None}
        if fmt == "gptq":
            return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                    "checkpoint_format": "gptq_v2" if gptq_v2 else "gptq", "static_groups": False,
                    "true_sequential": True}
        channel = group_size == -1
        weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "channel" if channel else "group",
                   "group_size": None if channel else group_size, "dynamic": False, "actorder": None,
                   "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None}},
                "ignore": ["lm_head", *ignore]}
    return Format(config, quantize)


FORMATS.update({
    "awq": lambda: int4_format("awq"),
    "gptq-sym": lambda: int4_format("gptq", sym=True),
    "gptq-asym": lambda: int4_format("gptq"),
    "gptq-desc-act": lambda: int4_format("gptq", desc_act=True),
    "gptq-v2": lambda: int4_format("gptq", gptq_v2=True),
    "ct-int4-sym": lambda: int4_format("compressed-tensors", sym=True),
    "ct-int4-asym": lambda: int4_format("compressed-tensors"),
    "ct-int4-channel": lambda: int4_format("compressed-tensors", group_size=-1),
    "gptq-channel": lambda: int4_format("gptq", group_size=-1, sym=True),
})


# ---- MXFP4: gpt-oss's experts ----------------------------------------------------------------------------

def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32], dequantized [..., K]) of weight [..., K]: each
    block of 32 values along the last dimension gets the power of two that brings its largest magnitude to at most
    6 (e8m0, biased by 127), and each value the nearest e2m1 value; two values a byte, the even one low."""
    from engine.layers.quant.mxfp4 import E2M1_VALUES

    table = torch.tensor(E2M1_VALUES, device=weight.device)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=weight.device)
    w = weight.float().unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(w.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0)).clamp(-127, 127)
    scaled = w / torch.exp2(exponent)[..., None]
    nibbles = torch.bucketize(scaled.abs().contiguous(), midpoints) + 8 * (scaled < 0)  # magnitude index, sign bit
    deq = table[nibbles] * torch.exp2(exponent)[..., None]
    blocks = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8), deq.flatten(-2)


MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4_checkpoint(src: Path, out: Path) -> Path:
    """`src` (a float gpt-oss written by transformers) with its experts in MXFP4 as OpenAI publishes gpt-oss
    (gate_up_proj_blocks [E, 2I, H/32, 16] and _scales [E, 2I, H/32] of gate_up_proj's transpose, down_proj_blocks
    [E, H, I/32, 16] and _scales of down_proj's; biases in float) to `out`, and the dequantized float checkpoint
    to `out`-dequantized; returns that reference's directory."""
    def convert(name: str, tensor: torch.Tensor):
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return None
        blocks, scales, deq = mxfp4_quantize(tensor.transpose(1, 2))
        return {f"{name}_blocks": blocks, f"{name}_scales": scales}, deq.transpose(1, 2).contiguous().to(tensor.dtype)

    return _write_quantized(src, out, convert,
                            {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_NOT_CONVERTED})


# ---- shared by the GPU tests of the quantized kernels (tests/test_gpu_quant_*.py) ----------------------------

def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(8, 300))] for _ in range(n)]


def prompt_logits(llm, prompt: list[int]) -> torch.Tensor:
    """float32 logits of every position of one prompt, one eager prefill."""
    from engine.execution.model_runner import prefill_inputs

    runner = llm.runner
    inputs = prefill_inputs([prompt], runner.block_size, -(-len(prompt) // runner.block_size))
    inputs.logits_indices = torch.arange(len(prompt))
    with torch.inference_mode():
        return runner.compute_logits(runner.forward(inputs), inputs).float()


def against_dequantized(model_dir, reference, prompts: list[list[int]]) -> tuple[list[float], int, int]:
    """The quantized checkpoint's bf16 prompt logits against its dequantized float checkpoint's: (each prompt's
    relative error, positions with the same top token, positions)."""
    from engine import LLM

    logits = []
    for path in (model_dir, reference):
        llm = LLM(str(path), dtype="bfloat16", enforce_eager=True, num_kvcache_blocks=64)
        logits.append([prompt_logits(llm, p) for p in prompts])
        llm.shutdown()
    ours, ref = logits
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(ours, ref)]
    same_top = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, ref))
    return errors, same_top, sum(len(p) for p in prompts)


def eager_and_graph_tokens(model_dir, prompts: list[list[int]], max_tokens: int = 24) -> tuple[list, list]:
    """Greedy tokens of the prompts with eager steps, then with the decode graphs."""
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = []
    for eager in (True, False):
        llm = LLM(str(model_dir), dtype="bfloat16", enforce_eager=eager, num_kvcache_blocks=128)
        outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.shutdown()
    return outs[0], outs[1]


def assert_graph_tokens_score_as_eager(model_dir, prompts: list[list[int]]) -> None:
    """Greedy tokens of eager steps and of the decode graphs, each scored by an eager prefill of the checkpoint
    (prompt_logprobs): the graphs' tokens lie as close to the best token as the eager steps' own (their mean
    log-probability below the best within 0.05 of eager's), and none far (1.5: a stale or wrong graph picks
    tokens several nats down)."""
    from engine import LLM, SamplingParams

    runs = eager_and_graph_tokens(model_dir, prompts)
    llm = LLM(str(model_dir), dtype="bfloat16", enforce_eager=True, num_kvcache_blocks=128)
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=1)
    gaps = []  # per run: each generated token's log-probability below the best, in the scoring prefill
    for tokens in runs:
        outs = llm.generate([p + t for p, t in zip(prompts, tokens)], scoring, use_tqdm=False)
        gaps.append([max(lp.logprob for lp in entry.values()) - entry[token].logprob
                     for out, p, t in zip(outs, prompts, tokens)
                     for entry, token in zip(out.prompt_logprobs[len(p):], t)])
    llm.shutdown()
    eager, graphs = (sum(g) / len(g) for g in gaps)
    print(f"mean log-probability below the best: eager {eager:.4f}, graphs {graphs:.4f}; "
          f"tokens equal in {sum(a == b for a, b in zip(*runs))}/{len(prompts)}")
    assert graphs <= eager + 0.05 and max(gaps[1]) < 1.5


def kv_cache_bytes(model: str, quantization: str | None = None) -> int:
    """The KV cache an engine of `model` (dummy weights; quantized as `redline bench --quantization` quantizes
    them, if given) sizes itself on this GPU."""
    from engine import LLM
    from worker.bench_engine import BENCH_QUANTIZATIONS, quantized_shape, resolve_model

    if quantization is not None:
        model = quantized_shape(resolve_model(model), BENCH_QUANTIZATIONS[quantization])
    llm = LLM(model, load_format="dummy", enforce_eager=True, max_model_len=4096)
    size = llm.runner.num_kvcache_blocks * llm.runner._kv_bytes_per_block()
    llm.shutdown()
    return size
