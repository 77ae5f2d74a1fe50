"""The gated MLP of the decoder families: down(act(gate(x)) * up(x)), gate and up as one packed projection."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.fusion import takes_gated_tma
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.parallel import TPGroup

# config.json's activation names → the engine's: SwiGLU (Llama, Qwen, Mistral, Phi-3), GeGLU with GELU's tanh
# approximation (Gemma)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class GatedMLP(nn.Module):
    """reduce_results=False: down_proj leaves each rank's part unsummed (for the norm after it to sum)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, tp: TPGroup,
                 reduce_results: bool = False):
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden activation {hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[hidden_act]
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp, reduce_results=reduce_results)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down(act(gate) * up) of gate_up_proj's output (which the layer computes with its norm)."""
        return self.down_proj.forward_act_and_mul(gate_up, self.act)

    def activates_in_gate_up(self, x: torch.Tensor) -> bool:
        """Whether, for x's rows, gate_up_proj's GEMM gives act(gate) * up itself (SwiGLU on one rank, the TMA
        GEMM's rows): the layer then calls down_proj on that."""
        # (not where an adapter's product is added after the GEMM)
        return (self.act == "silu" and self.gate_up_proj.tp.size == 1 and not self.gate_up_proj.lora_active
                and takes_gated_tma(x, self.gate_up_proj.weight))
