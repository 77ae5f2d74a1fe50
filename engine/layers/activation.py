import torch
from torch import nn

from engine.layers.fusion import silu_and_mul


class SiluAndMul(nn.Module):
    """silu(gate) * up over a packed [gate | up] input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
