"""Sampling-kernel problems of tests/test_sampling_kernel.py.

Each case runs engine.kernels.sampling.gumbel_argmax and returns plain lists (JSON-ready), so the
CPU tests can run it under the Triton interpreter in a subprocess and assert on what comes back.
Imports nothing from the engine but the kernel.
"""
from __future__ import annotations

import torch

# (num_splits, block): one tile, one split over many tiles, several splits, the automatic choice
CPU_LAYOUTS = [(1, 64), (1, 8), (3, 16), (5, 8), (None, 8), (None, None)]
GPU_LAYOUTS = [(1, None), (4, 1024), (37, 4096), (None, 512), (None, None)]
# 1, 2, 7 and 26 splits of 203 columns (no multiple of any block), one tile, the automatic choice
FUSED_CPU_LAYOUTS = [(1, 256), (1, 8), (2, 16), (7, 8), (26, 8), (None, None)]
FUSED_GPU_LAYOUTS = GPU_LAYOUTS + [(2, None), (7, 4096)]


def strided(values: torch.Tensor, dtype: torch.dtype, device: str, pad: int = 11) -> torch.Tensor:
    """`values` [S, V] as a view of a wider buffer (row stride V + pad), padding full of huge logits."""
    buffer = torch.full((values.shape[0], values.shape[1] + pad), 1.0e4, dtype=dtype, device=device)
    buffer[:, :values.shape[1]] = values.to(dtype)
    return buffer[:, :values.shape[1]]


def run(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, layout) -> list[int]:
    from engine.kernels.sampling import gumbel_argmax

    num_splits, block = layout
    kwargs = {"num_splits": num_splits} | ({"block": block} if block else {})
    return gumbel_argmax(logits, temperatures, seed, **kwargs).tolist()


def greedy_case(device: str, vocab: int, layouts: list, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Greedy rows (t = 0) between sampled rows: random rows, a row of ties (across lanes, tiles and
    splits), an all -inf row, a maximum in the last column. Returns torch.argmax and each layout's tokens."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(8, vocab, generator=gen) * 3
    ties = [5, 13, vocab // 2, vocab - 1]
    values[2, ties] = 40.0
    values[4] = float("-inf")
    values[6, :vocab // 3] = float("-inf")
    values[6, -1] = 30.0
    logits = strided(values, dtype, device)
    temperatures = torch.tensor([0.0, 1.0, 0.0, 0.3, 0.0, 2.0, 0.0, 0.0], device=device)
    greedy_rows = [i for i, t in enumerate(temperatures.tolist()) if t == 0]
    return {"greedy_rows": greedy_rows, "argmax": logits.argmax(dim=-1).tolist(),
            "layouts": {str(layout): run(logits, temperatures, 11, layout) for layout in layouts}}


def distribution_case(device: str, seeds: list[int], rows_per_temperature: int, num_splits: int = 2,
                      block: int = 8) -> dict:
    """Token counts over many seeds for one 10-token row at t = 0.5 and t = 2 (rows interleaved, in a
    strided bf16 buffer, `num_splits` splits forced), and softmax(logits / t) from the same bf16 logits."""
    vocab = 10
    temperatures = [0.5, 2.0]
    row = torch.linspace(0.0, 3.0, vocab).to(torch.bfloat16)
    logits = strided(row.repeat(rows_per_temperature * len(temperatures), 1), torch.bfloat16, device)
    temps = torch.tensor(temperatures, device=device).repeat(rows_per_temperature)
    counts = torch.zeros(len(temperatures), vocab, dtype=torch.int64)
    for seed in seeds:
        tokens = torch.tensor(run(logits, temps, seed, (num_splits, block)))
        for i in range(len(temperatures)):
            counts[i] += torch.bincount(tokens[i::len(temperatures)], minlength=vocab)
    expected = [(row.float() / t).softmax(-1).tolist() for t in temperatures]
    return {"temperatures": temperatures, "counts": counts.tolist(), "expected": expected,
            "logits": row.float().tolist()}


def layout_case(device: str, vocab: int, layouts: list, num_rows: int = 8) -> dict:
    """One seed, sampled rows (and one greedy row), every layout: the tokens of each."""
    gen = torch.Generator().manual_seed(4)
    logits = strided(torch.randn(num_rows, vocab, generator=gen), torch.float16, device)
    temperatures = torch.full((num_rows,), 1.5, device=device)
    temperatures[1] = 0.0
    return {str(layout): run(logits, temperatures, 2024, layout) for layout in layouts}


def seed_case(device: str, vocab: int = 37, num_rows: int = 32, layout=(2, 16)) -> dict:
    """Identical rows at t = 1: seed 7 twice and seed 8 once."""
    logits = strided(torch.zeros(num_rows, vocab), torch.float32, device)
    temperatures = torch.ones(num_rows, device=device)
    return {"first": run(logits, temperatures, 7, layout), "again": run(logits, temperatures, 7, layout),
            "other": run(logits, temperatures, 8, layout), "in_memory": seed_in_memory(logits, temperatures, 7, layout)}


def seed_in_memory(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, layout) -> list[int]:
    """The tokens with the seed read from a device tensor (as a CUDA graph replays it), written into a
    given buffer; -1 marks a row left unwritten."""
    from engine.kernels.sampling import gumbel_argmax

    num_splits, block = layout
    kwargs = {"num_splits": num_splits} | ({"block": block} if block else {})
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
    seed_tensor = torch.tensor([seed], dtype=torch.int64, device=logits.device)
    returned = gumbel_argmax(logits, temperatures, seed_tensor, out=out, **kwargs)
    assert returned.data_ptr() == out.data_ptr(), "the tokens go into `out`"
    return out.tolist()


def take_pending_case(device: str) -> dict:
    """take_pending against torch.where over rows with and without a pending token, odd sizes included."""
    from engine.kernels.sampling import take_pending

    gen = torch.Generator().manual_seed(5)
    mismatches, sizes = 0, [1, 7, 300, 1500]
    for n in sizes:
        tokens = torch.randint(0, 50000, (n + 3,), generator=gen).to(device)
        input_ids = torch.randint(0, 50000, (n,), generator=gen).to(device)
        src = torch.where(torch.rand(n, generator=gen) < 0.5, torch.randint(0, n + 3, (n,), generator=gen),
                          torch.full((n,), -1)).to(device)
        expected = torch.where(src >= 0, tokens.index_select(0, src.clamp(min=0)), input_ids)
        mismatches += int((take_pending(input_ids, src, tokens) != expected).sum().item())
    return {"sizes": sizes, "mismatches": mismatches}


def token_logprobs_case(device: str, vocab: int, layouts: list) -> dict:
    """token_logprobs against torch's log_softmax, bf16 and fp32 rows with the row stride of a wider buffer:
    random rows, a row of huge logits, a row -inf but for a few columns, the token in the last column.
    Returns the largest absolute difference per dtype and layout."""
    from engine.kernels.sampling import token_logprobs

    gen = torch.Generator().manual_seed(9)
    values = torch.randn(6, vocab, generator=gen) * 4
    values[1] += 300.0
    values[3, : vocab - 3] = float("-inf")
    tokens = torch.tensor([0, 5, vocab // 2, vocab - 1, 11 % vocab, vocab - 2], dtype=torch.int64, device=device)
    worst = {}
    for dtype in (torch.bfloat16, torch.float32):
        logits = strided(values, dtype, device)
        expected = logits.float().log_softmax(-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        for num_splits, block in layouts:
            kwargs = {"num_splits": num_splits} | ({"block": block} if block else {})
            got = token_logprobs(logits, tokens, **kwargs)
            worst[f"{dtype} {num_splits} {block}"] = float((got - expected).abs().max())
    return worst


def fused_logprobs_case(device: str, vocab: int, layouts: list) -> dict:
    """gumbel_argmax with logprobs_out, as the decode graph calls it (seed and outputs in device tensors),
    against the same call without: greedy and sampled rows, a row of huge logits, one -inf over its first
    two thirds (whole splits of nothing but -inf), one -inf in every third column, one -inf but for its
    last columns. Returns, per dtype and layout, the rows whose token differs and the largest absolute
    difference from torch's log_softmax of the raw logits at the token."""
    from engine.kernels.sampling import gumbel_argmax

    gen = torch.Generator().manual_seed(12)
    values = torch.randn(8, vocab, generator=gen) * 4
    values[1] += 300.0
    values[2, : 2 * vocab // 3] = float("-inf")
    values[3, ::3] = float("-inf")
    values[5, : vocab - 3] = float("-inf")
    values[6, -1] = 40.0
    temperatures = torch.tensor([0.0, 1.0, 0.5, 0.0, 2.0, 1.0, 0.0, 0.7], device=device)
    seed = 31
    seed_tensor = torch.tensor([seed], dtype=torch.int64, device=device)
    token_changes, worst = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        logits = strided(values, dtype, device)
        log_softmax = logits.float().log_softmax(-1)
        for num_splits, block in layouts:
            kwargs = {"num_splits": num_splits} | ({"block": block} if block else {})
            tokens = torch.full((8,), -1, dtype=torch.int64, device=device)
            logprobs = torch.full((8,), float("nan"), device=device)
            gumbel_argmax(logits, temperatures, seed_tensor, out=tokens, logprobs_out=logprobs, **kwargs)
            alone = gumbel_argmax(logits, temperatures, seed, **kwargs)
            expected = log_softmax.gather(1, tokens.clamp(min=0).unsqueeze(1)).squeeze(1)
            key = f"{dtype} {num_splits} {block}"
            token_changes[key] = (tokens != alone).nonzero().flatten().tolist()
            worst[key] = float((logprobs - expected).abs().max())  # NaN where a row was left unwritten
    return {"token_changes": token_changes, "worst": worst, "sampled_tokens": alone.tolist()}


def _main() -> None:
    """Every CPU case under the Triton interpreter; prints one JSON object."""
    import json
    import os
    import sys

    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torch.set_num_threads(1)
    results = {
        "greedy": greedy_case("cpu", 37, CPU_LAYOUTS),
        "greedy_fp32": greedy_case("cpu", 37, [(3, 16)], torch.float32),
        "distribution": distribution_case("cpu", seeds=[0, 1, 2, 3], rows_per_temperature=150),
        "layouts": layout_case("cpu", 37, CPU_LAYOUTS),
        "seeds": seed_case("cpu"),
        "take_pending": take_pending_case("cpu"),
        "token_logprobs": token_logprobs_case("cpu", 37, CPU_LAYOUTS),
        "fused_logprobs": fused_logprobs_case("cpu", 203, FUSED_CPU_LAYOUTS),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
