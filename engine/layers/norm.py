import torch
from torch import nn

from engine.layers.fusion import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm in float32; with `residual`, adds it first and returns the new residual too.

    prefetch: (tensor, bytes) pairs this layer's kernel queues into the L2 cache on CUDA (weights of a
    GEMM that follows soon; set by the model, see DecoderModel.plan_l2_prefetch).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.prefetch: list = []

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.prefetch)
        return add_rms_norm(x, residual, self.weight, self.eps, self.prefetch)
