"""Int4 weights in groups along the input dimension: AWQ (gemm), GPTQ (4-bit; sym and asym; desc_act false and
true) and compressed-tensors pack-quantized, each loaded from its own tensors and repacked once into the one
layout the kernels read (engine/kernels/int4_gemm.py):

    qweight int32 [K / 8, N_rank]    q[k, n] in 0..15, eight rows of K an int32 (nibble j: row 8i + j)
    scales        [K / G, N_rank]    the checkpoint's float dtype (fp16 for AWQ and GPTQ)
    zeros   uint8 [K / G, N_rank]    W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]
    perm    int64 [K_rank] or none   GPTQ desc_act: input features in group order (see below)

with K the layer's input features and N its output features (this rank's slice of one of them). How each format
stores them (K in, N out; "packed along X": eight consecutive values of X in an int32, value j at bits 4j):

  AWQ gemm   qweight [K, N / 8] and qzeros [K / G, N / 8], packed along N in the order 0, 2, 4, 6, 1, 3, 5, 7
             (nibble j holds column AWQ_ORDER[j] of its eight); scales [K / G, N]; W = (q - z) * s
  GPTQ       qweight [K / 8, N] packed along K; qzeros [K / G, N / 8] packed along N; scales [K / G, N];
             g_idx [K], each input feature's group. The original format (checkpoint_format "gptq") stores each
             zero minus one (a symmetric checkpoint's 8 as 7), "gptq_v2" the zero itself
  pack-quantized (compressed-tensors, strategy group or channel): weight_packed [N, K / 8] packed along K,
             values stored as q + 8 (q signed, -8..7); weight_scale [N, K / G]; weight_zero_point (asymmetric
             only) [N / 8, K / G] packed along N, stored + 8 alike; weight_shape [2] = (N, K); W = (q - zp) * s

desc_act: GPTQ's act-order checkpoints quantized input features in an order of their own, so a group's
features are scattered: g_idx says which group each belongs to. Rather than look groups up per row in the
kernels, the rows are sorted by group once at load (as vLLM's exllama path does), the permutation kept, and
the activations' features gathered in that order before the product: x[:, perm] @ W[perm] = x @ W.

Tensor parallelism: a column-parallel layer keeps its slice of N of every tensor; a row-parallel one its slice
of K, which must hold whole groups (a tensor_parallel_size that splits a group is refused in one line). A
row-parallel layer of a desc_act checkpoint takes tensor_parallel_size 1 only: its rank's features belong to
groups scattered over every rank.
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c of eight sits in nibble _AWQ_UNDO[c]


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 values 0..15 of an int32 tensor packed along `dim` (eight consecutive values an int32, value j at
    bits 4j): that dimension grows eightfold."""
    dim = dim % packed.dim()
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    view = [1] * (packed.dim() + 1)
    view[dim + 1] = 8
    values = (packed.to(torch.int32).unsqueeze(dim + 1) >> shifts.view(view)) & 0xF
    return values.flatten(dim, dim + 1).to(torch.uint8)


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The int32 tensor that unpack_int4(., dim) turns back into `values` (0..15; that dimension a multiple
    of 8)."""
    dim = dim % values.dim()
    if values.shape[dim] % 8:
        raise ValueError(f"int4 values of shape {tuple(values.shape)} cannot be packed by eight along dim {dim}")
    grouped = values.to(torch.int32).unflatten(dim, (-1, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=values.device)
    view = [1] * grouped.dim()
    view[dim + 1] = 8
    return _or_reduce(grouped << shifts.view(view), dim + 1)


def _or_reduce(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The bitwise or of x's slices along dim (the nibbles never overlap)."""
    out = torch.zeros_like(x.select(dim, 0))
    for j in range(x.shape[dim]):
        out |= x.select(dim, j)
    return out


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's qweight [K, N / 8] or qzeros [K / G, N / 8]: uint8 [rows, N] in column order."""
    values = unpack_int4(packed, -1)
    return values.unflatten(-1, (-1, 8))[..., list(_AWQ_UNDO)].flatten(-2)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """The AWQ packing of uint8 [rows, N] (the inverse of awq_unpack)."""
    return pack_int4(values.unflatten(-1, (-1, 8))[..., list(AWQ_ORDER)].flatten(-2), -1)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W [K, N] in `dtype` of the layout above (computed in float32, rounded once)."""
    q = unpack_int4(qweight, 0).float()
    group = q.shape[0] // scales.shape[0]
    w = (q - zeros.float().repeat_interleave(group, 0)) * scales.float().repeat_interleave(group, 0)
    return w.to(dtype)


def group_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The permutation that puts GPTQ's input features in group order, None where they already are; ValueError
    where g_idx does not give each group group_size features."""
    g_idx = g_idx.long()
    k = g_idx.numel()
    natural = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx, natural):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], natural):
        raise ValueError(f"GPTQ g_idx does not put {group_size} input features in each group; the engine runs "
                         "group-ordered (desc_act) checkpoints of equal groups only")
    return perm
