"""Cases of engine/kernels/token_mask.py against the torch reference engine/grammar_mask.apply; run under the
Triton interpreter by tests/test_structured_output.py (on CUDA by its gpu test)."""
from __future__ import annotations

import torch


def mask_case(device: str, vocab: int) -> dict:
    """Random bitmasks (bit 31 of words set and clear, a row allowing one token, one allowing none) on two of
    five rows of bf16 and fp32 logits with the stride of a wider buffer: the rows the kernel leaves must equal
    the reference's. Returns the mismatching elements per dtype (NaN-free: -inf compares equal)."""
    from engine.kernels.token_mask import mask_logits
    from engine.sampling import grammar_mask

    gen = torch.Generator().manual_seed(3)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = 0
    bitmask[1, (vocab - 1) // 32] = 1 << ((vocab - 1) % 32) if (vocab - 1) % 32 < 31 else -2**31
    bitmask[2] = 0
    rows = torch.tensor([4, 0, 2], dtype=torch.int64)
    values = torch.randn(5, vocab + 7, generator=gen)
    result = {}
    for dtype in (torch.bfloat16, torch.float32):
        base = values.to(dtype)[:, :vocab]
        expected = base.float().clone()
        grammar_mask.apply(expected, grammar_mask.GrammarRows([0, 1, 2], rows, bitmask))
        got = base.to(device).clone() if device != "cpu" else values.to(dtype).clone()[:, :vocab]
        mask_logits(got, bitmask.to(device), rows.to(device))
        result[str(dtype)] = int((got.float().cpu() != expected).sum())
    return result


def _main() -> None:
    import json
    import os
    import sys

    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torch.set_num_threads(1)
    print(json.dumps({"vocab_37": mask_case("cpu", 37), "vocab_2085": mask_case("cpu", 2085),
                      "vocab_64": mask_case("cpu", 64)}))


if __name__ == "__main__":
    _main()
