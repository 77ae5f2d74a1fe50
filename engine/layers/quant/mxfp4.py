"""MXFP4 experts, as OpenAI publishes gpt-oss (`quant_method: "mxfp4"`): every expert's weights in blocks of 32
values along the input dimension, each value an e2m1 float (4 bits: sign, 2 exponent bits, 1 mantissa bit:
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) and each block one e8m0 scale (a power of two, 2^(byte - 127)).
The rest of the model (attention, router, embeddings, head) stays bf16; its linears are never quantized here.

The checkpoint's tensors, per layer (E experts, H hidden, I intermediate):
    mlp.experts.gate_up_proj_blocks uint8 [E, 2I, H / 32, 16]   two values a byte, the even one in the low nibble;
                                                                 rows alternate gate, up (as the bf16 gate_up_proj's
                                                                 columns do)
    mlp.experts.gate_up_proj_scales uint8 [E, 2I, H / 32]
    mlp.experts.down_proj_blocks    uint8 [E, H, I / 32, 16]
    mlp.experts.down_proj_scales    uint8 [E, H, I / 32]
    (the biases, gate_up_proj_bias and down_proj_bias, in bf16 as in the float checkpoint)

The engine keeps them packed, in ExpertWeights' layout (engine/layers/moe.py): w13_blocks [E, 2I_rank, H / 2] (the
rank's gate rows, then its up rows) with w13_scales [E, 2I_rank, H / 32], w2_blocks [E, H, I_rank / 2] with
w2_scales [E, H, I_rank / 32]. On CUDA the fused MoE kernels read them directly and dequantize each tile in
registers (engine/kernels/fused_moe.py); elsewhere the experts are dequantized to the activations' dtype for each
forward (the reference). Tensor parallelism splits I, in whole blocks of 32: a size that would split a block is
refused in one line.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from engine.layers.quant import QuantMethod

BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
# dummy weights: bytes of two varied values, scales of 2^-6 (weights of about the float dummies' size)
DUMMY_BLOCKS = 0x2B
DUMMY_SCALE = SCALE_BIAS - 6


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., K] float weights of packed blocks [..., K / 2] (uint8) and scales [..., K / 32] (e8m0), in dtype
    (exact in bf16 and float32: each value is an e2m1 value times a power of two)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((table[(blocks & 0xF).long()], table[(blocks >> 4).long()]), dim=-1).flatten(-2)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values.unflatten(-1, (-1, BLOCK)), exponents.unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


class Mxfp4Method(QuantMethod):
    """gpt-oss's MXFP4 experts; every linear layer stays in float."""

    name = "mxfp4"
    quantizes_experts = True

    def quantizes(self, checkpoint_names: list[str]) -> bool:
        return False

    def create_experts(self, experts: nn.Module) -> None:
        """The packed parameters of ExpertWeights `experts` (this rank's slice of I)."""
        e, hidden, inter = experts.num_experts, experts.hidden_size, experts.local_inter
        full_inter = inter * experts.tp.size
        if inter % BLOCK or hidden % BLOCK:
            raise ValueError(f"tensor_parallel_size {experts.tp.size} would split the MXFP4 blocks of {BLOCK}: a rank "
                             f"would hold {inter} of the experts' {full_inter} intermediate features; use a size that "
                             f"leaves a multiple of {BLOCK}")
        shapes = {"w13_blocks": ((e, 2 * inter, hidden // 2), (e, 2 * full_inter, hidden // BLOCK, 16)),
                  "w13_scales": ((e, 2 * inter, hidden // BLOCK), (e, 2 * full_inter, hidden // BLOCK)),
                  "w2_blocks": ((e, hidden, inter // 2), (e, hidden, full_inter // BLOCK, 16)),
                  "w2_scales": ((e, hidden, inter // BLOCK), (e, hidden, full_inter // BLOCK))}
        for name, (shape, full_shape) in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
            param.full_shape = full_shape
            param.dummy_value = DUMMY_BLOCKS if name.endswith("blocks") else DUMMY_SCALE
            param.weight_loader = functools.partial(_load, experts, name)
            param.load_full = functools.partial(_load, experts, name, shard_id=None)
            experts.register_parameter(name, param)

    def dequantized(self, experts: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in dtype: the float experts of the reference path."""
        return (dequantize(experts.w13_blocks, experts.w13_scales, dtype),
                dequantize(experts.w2_blocks, experts.w2_scales, dtype))


def _load(experts: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """One checkpoint tensor of every expert (shard ids as ExpertWeights': (None, part)): this rank's slice."""
    tp, inter = experts.tp, experts.local_inter
    if name.startswith("w13"):
        loaded = loaded.flatten(2)  # blocks: [E, 2I, H / 2]; scales as they are
        gate, up = loaded[:, 0::2], loaded[:, 1::2]  # rows alternate gate, up
        rows = [part.narrow(1, tp.rank * inter, inter) for part in (gate, up)]
        param.data.copy_(torch.cat(rows, dim=1))
    else:  # the intermediate features are the packed dimension: whole blocks
        loaded = loaded.flatten(2)
        per_rank = inter // 2 if name.endswith("blocks") else inter // BLOCK
        param.data.copy_(loaded.narrow(2, tp.rank * per_rank, per_rank))
