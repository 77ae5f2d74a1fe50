"""Which tensor-parallel rank a layer lives on, passed to layers explicitly (no process globals)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def broadcast_from_rank0(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (the others pass a buffer of the same shape)."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's slice of the last dimension (vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator
