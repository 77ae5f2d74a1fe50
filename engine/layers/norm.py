import torch
from torch import nn

from engine.layers.fusion import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm in float32; with `residual`, adds it first and returns the new residual too."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
