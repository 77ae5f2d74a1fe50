import torch
from torch import nn

from engine.layers.fusion import add_rms_norm, add_rms_norm_linear, rms_norm, takes_gemv
from engine.layers.parallel import SINGLE, TPGroup


class RMSNorm(nn.Module):
    """RMSNorm in float32; with `residual`, adds it first and returns the new residual too.

    With a residual, x is this rank's part of a sum over the ranks of `tp` (a row-parallel projection's
    output left unsummed): the all-reduce, the residual add and the norm run as one step.
    """

    unit_offset = False  # GemmaRMSNorm: the checkpoint's weight is the scale's offset from one

    def __init__(self, hidden_size: int, eps: float = 1e-6, tp: TPGroup = SINGLE):
        super().__init__()
        self.eps = eps
        self.tp = tp
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.unit_offset)
        if self.tp.size == 1:
            return add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
        return self.tp.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)

    def linear(self, x: torch.Tensor, residual: torch.Tensor | None, proj,
               gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(proj(norm of x + residual), x + residual), or without a residual (proj(norm of x), x). On one
        rank, for the rows the GEMV takes (decode), the add and the norm run in the projection's prologue:
        one kernel less. gated (one rank, rows the TMA GEMM takes: fusion.takes_gated_tma): proj is the
        [gate | up] projection and the first result silu(gate) * up, from the GEMM's epilogue."""
        lora = proj.lora_active  # under an adapter, only where its shrink can take the norm into its prologue too
        if (self.tp.size == 1 and proj.tp.size == 1 and proj.quant is None  # quantized: no float weight to fuse
                and (not lora or (not gated and takes_gemv(x, proj.weight)))):
            out, residual = add_rms_norm_linear(x, residual, self.weight, self.eps, proj.weight, proj.bias, gated=gated,
                                                unit_offset=self.unit_offset)
            return (proj.lora.add_normed(residual, out, self) if lora else out), residual
        if gated:
            raise ValueError("RMSNorm.linear(gated=True) runs on one rank only")
        if residual is None:
            return proj(self(x)), x
        x, residual = self(x, residual)
        return proj(x), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) x (1 + weight), in float32 and rounded once. Its input is always whole (the
    Gemma layers sum their projections before their norms), so it takes no tensor-parallel group."""

    unit_offset = True

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
