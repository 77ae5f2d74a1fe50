"""Cases of engine/kernels/penalties.py against the torch path of engine/sampling/penalties.apply; run under the
Triton interpreter by tests/test_sampling.py (on CUDA by its gpu test)."""
from __future__ import annotations

import torch


def penalty_case(device: str, vocab: int) -> dict:
    """Three of five rows of float32 logits (with a wider buffer's stride) penalised from rows of a five-row
    TokenCounts (counts 0-3, prompt tokens, positive and negative logits, one row with penalties that change
    nothing): the kernel's logits against the torch path's. Returns the largest difference, the rows the
    kernel must leave untouched, and how many elements the penalties changed (so that the case is not empty)."""
    from engine.kernels.penalties import apply_penalties
    from engine.sampling import penalties

    gen = torch.Generator().manual_seed(5)
    counts = penalties.TokenCounts(torch.device("cpu"), vocab)
    for seq_id in range(5):
        counts.slot(seq_id, torch.randint(0, vocab, (vocab // 7 + 1,), generator=gen).tolist())
    counts.counts[:] = torch.randint(0, 4, counts.counts.shape, generator=gen, dtype=torch.int32)
    counts.counts[:, ::3] = 0
    rows = torch.tensor([4, 0, 2], dtype=torch.int64)
    slots = torch.tensor([counts.slot_of[1], counts.slot_of[3], counts.slot_of[4]], dtype=torch.int64)
    rep = torch.tensor([[1.1], [0.7], [1.0]])
    freq = torch.tensor([[0.5], [-0.3], [0.0]])
    pres = torch.tensor([[0.25], [1.5], [0.0]])
    adj = penalties.LogitAdjustments(rows, slots, rep, freq, pres, None, None, None, False)
    values = torch.randn(5, vocab + 9, generator=gen) * 4
    expected = values[:, :vocab].clone()
    penalties.apply(expected, adj, counts)
    got = values.clone().to(device)[:, :vocab]
    apply_penalties(got, rows.to(device), slots.to(device), counts.counts.to(device), counts.in_prompt.to(device),
                    rep.to(device), freq.to(device), pres.to(device))
    got = got.cpu()
    return {"max_diff": float((got - expected).abs().max()),
            "untouched_equal": bool(torch.equal(got[[1, 3]], values[[1, 3], :vocab])),
            "changed": int((expected != values[:, :vocab]).sum())}


def _main() -> None:
    import json
    import os
    import sys

    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torch.set_num_threads(1)
    print(json.dumps({"vocab_37": penalty_case("cpu", 37), "vocab_5000": penalty_case("cpu", 5000)}))


if __name__ == "__main__":
    _main()
