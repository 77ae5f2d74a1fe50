"""Cases for the LoRA shrink/expand kernels (engine/kernels/lora.py) under the Triton interpreter, against the
torch path (engine/lora/layers.py's row groups). Run by tests/test_lora_kernels.py with TRITON_INTERPRET=1 (or
on a GPU with --device cuda). Prints one JSON object: {case: outcome}."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels.lora import LoRATiles, lora_add, make_tiles, max_tiles  # noqa: E402


def reference(x, out, a, b, slot_ids):
    want = out.float().clone()
    for row, slot in enumerate(slot_ids.tolist()):
        if slot >= 0:
            want[row] += (x[row].float() @ a[slot].float().T) @ b[slot].float().T
    return want


def tiles_on(slot_ids, device, pad_to: int = 0) -> LoRATiles:
    order, slots, starts, ends = make_tiles(slot_ids)
    pad = max(0, pad_to - len(slots))
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return LoRATiles(as_i32(order or [0]), as_i32(slots + [-1] * pad), as_i32(starts + [0] * pad),
                     as_i32(ends + [0] * pad))


def case(rows: int, k: int, n: int, w: int, slots: int, dtype, device, pad: bool = False, seed: int = 0,
         prologue: str | None = None) -> dict:
    """prologue "norm" / "unit_norm" (Gemma's): x is a residual sum the kernel RMS-norms first; "silu_and_mul":
    x is [gate | up] rows, 2k wide."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * k if prologue == "silu_and_mul" else k, generator=gen).to(dtype).to(device)
    out = torch.randn(rows, n, generator=gen).to(dtype).to(device)
    a = (torch.randn(slots, w, k, generator=gen) * 0.1).to(dtype).to(device)
    b = (torch.randn(slots, n, w, generator=gen) * 0.1).to(dtype).to(device)
    norm_weight = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(device)
    slot_ids = torch.randint(-1, slots, (rows,), generator=gen)
    kwargs, inputs = {}, x.cpu().float()
    if prologue in ("norm", "unit_norm"):
        unit = prologue == "unit_norm"
        kwargs["norm"] = (norm_weight, 1e-6, unit)
        scale = norm_weight.cpu().float() + (1.0 if unit else 0.0)
        inputs = inputs * torch.rsqrt(inputs.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    elif prologue == "silu_and_mul":
        kwargs["silu_and_mul"] = True
        gate, up = inputs.chunk(2, -1)
        inputs = torch.nn.functional.silu(gate) * up
    want = reference(inputs, out.cpu(), a.cpu(), b.cpu(), slot_ids)
    tiles = tiles_on(slot_ids, device, max_tiles(rows, slots) if pad else 0)
    base_rows = (slot_ids == -1).to(device)
    before = out.clone()
    lora_add(x, out, a, b, tiles, **kwargs)
    err = float((out.float().cpu() - want).abs().max() / want.abs().max())
    return {"relative_error": err, "base_rows_changed": int((out[base_rows] != before[base_rows]).sum())}


def engine_on_kernels() -> dict:
    """A CPU engine whose LoRA projections run the kernels (as on CUDA), against the same engine's torch path:
    the pool's packed A/B layout, the rows' tiles and the strides the layers hand the kernels."""
    import importlib
    import tempfile

    from engine import LLM, LoRARequest, SamplingParams
    from engine.lora import layers
    from tests.conftest import make_checkpoint
    from tests.lora_helpers import ADAPTERS, make_adapter

    with tempfile.TemporaryDirectory() as tmp:
        base = make_checkpoint("qwen3", Path(tmp) / "base")
        requests = [LoRARequest(name, i + 1, str(make_adapter(base, Path(tmp) / name, rank, alpha, targets, rslora, i)))
                    for i, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS[:2])]
        prompts = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11], [40, 41, 42], [300, 2, 77, 81, 90]]
        loras = [requests[0], None, requests[1]]
        greedy = SamplingParams(temperature=0, max_tokens=4)

        def run() -> list[list[int]]:
            llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16)
            return [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False, lora_request=loras)]

        torch_tokens = run()
        plain = LLM(str(base), device="cpu")
        base_tokens = [o.token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
        kernels = importlib.import_module("engine.kernels.lora")
        norm_module = importlib.import_module("engine.layers.norm")
        calls = []
        set_rows = layers.LoRAPool.set_rows
        lora_add = kernels.lora_add

        def recorded(*args, norm=None, silu_and_mul=False):
            calls.append("norm" if norm is not None else "silu_and_mul" if silu_and_mul else "plain")
            return lora_add(*args, norm=norm, silu_and_mul=silu_and_mul)

        def set_rows_with_tiles(pool, slot_ids, device):
            set_rows(pool, slot_ids, device)
            if pool.groups:  # what the pool builds on CUDA
                tiles = kernels.make_tiles(slot_ids)
                pool.tiles = kernels.LoRATiles(*(torch.tensor(v, dtype=torch.int32) for v in tiles))

        layers.LoRAPool.set_rows = set_rows_with_tiles
        layers._kernels_for = lambda x, weight, name: kernels
        kernels.lora_add = recorded
        # the rows go to the GEMV as a decode step's do on CUDA: the norms stay fused, their shrinks take them
        norm_module.takes_gemv = lambda rows, weight: True
        kernel_tokens = run()
    return {"tokens_equal": kernel_tokens == torch_tokens, "kernel_calls": {c: calls.count(c) for c in set(calls)},
            "adapters_change_tokens": base_tokens[0] != torch_tokens[0] and base_tokens[2] != torch_tokens[2]}


def main(device: str) -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    results = {
        "decode_fp32": case(7, 64, 96, 16, 3, f32, device),
        "prefill_fp32": case(45, 64, 80, 48, 4, f32, device, seed=1),     # several tiles of one slot
        "padded_tiles_fp32": case(20, 32, 64, 16, 2, f32, device, pad=True, seed=2),  # graph-style empty tiles
        "decode_bf16": case(9, 128, 192, 64, 4, bf16, device, seed=3),
        "split_k_fp32": case(21, 1000, 64, 32, 3, f32, device, pad=True, seed=4),  # K in 3 parts, the last short
        # the shrink's prologues, each over a split K: the norm's sums of squares span every part
        "norm_fp32": case(19, 600, 64, 48, 3, f32, device, pad=True, seed=5, prologue="norm"),
        "unit_norm_bf16": case(11, 512, 128, 32, 2, bf16, device, seed=6, prologue="unit_norm"),
        "silu_and_mul_fp32": case(17, 520, 80, 16, 3, f32, device, seed=7, prologue="silu_and_mul"),
    }
    if device == "cpu":
        results["engine_on_kernels"] = engine_on_kernels()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu")
