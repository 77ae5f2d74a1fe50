"""The experts of a mixture-of-experts layer in two grouped GEMMs over every expert (engine/layers/moe.py).

A token routed to k experts is k slots (slot s = token * k + j). The align step (`align_slots`) sorts the slots
by expert and pads each expert's run to a multiple of BLOCK_M with a sentinel slot, so that every block of
BLOCK_M sorted slots belongs to one expert. Then:

  gate_up_act: each program takes a block of slots and BLOCK_N columns of its expert's gate and up rows,
      h[slot] = act(x[token] @ gate.T + b_gate, x[token] @ up.T + b_up)        (one pass over x for both)
  down_weighted: out[slot] = (h[slot] @ down.T + b_down) * weight[slot]
  and the k slots of each token are summed (torch).

Everything runs on the device from tensors whose sizes come from shapes alone: no host sync, so decode steps
are captured in CUDA graphs. Blocks past the padded total (read from the device) return at once. Accumulates in
float32; h and the slot outputs are rounded to the model dtype, as the reference (engine/layers/moe.py
experts_reference) rounds between its GEMMs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import interpreted, precise_dot
from engine.kernels.paged_tiles import upcast_dot

ACTS = {"silu": 0, "swiglu_clamped": 1}


def block_sizes(num_slots: int, num_experts: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): blocks of slots sized to the slots per expert (decode
    steps have few: a larger BLOCK_M would be mostly padding, and each block reads its expert's weights once)."""
    if interpreted():
        return 16, 32, 32, 4, 1
    per_expert = num_slots / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    return block_m, 64, 64, 4, 3


def align_slots(experts: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_slots [capacity] int32, block_experts [capacity / block_m] int32, num_padded [1]) of the routed
    experts [T, k]: slots sorted by expert, each expert's run padded to a multiple of block_m with the sentinel
    T * k; block b's expert; the padded total. Capacity bounds the total from the shapes alone."""
    num_slots = experts.numel()
    device = experts.device
    flat = experts.flatten().long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    dest = padded_end[by_expert] - padded[by_expert] + torch.arange(num_slots, device=device) - run_start[by_expert]
    used = min(num_experts, num_slots)  # experts with at least one slot, at most
    capacity = -(-(num_slots + used * (block_m - 1)) // block_m) * block_m
    sorted_slots = torch.full((capacity,), num_slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_slots, block_experts.to(torch.int32), padded_end[-1:]


@triton.jit
def _block_slots(sorted_slots_ptr, block_experts_ptr, num_padded_ptr, num_slots, BLOCK_M: tl.constexpr):
    """(the block's slots, which of them are real, its expert, whether the block is past the padded total)."""
    pid_m = tl.program_id(0)
    past = pid_m * BLOCK_M >= tl.load(num_padded_ptr)
    slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    return slots, slots < num_slots, expert, past


@triton.jit
def _gate_up_act_kernel(x_ptr, w_ptr, b_ptr, h_ptr, sorted_slots_ptr, block_experts_ptr, num_padded_ptr,
                        num_slots, N, K, stride_xm, stride_we, stride_wn, stride_be, stride_hm, alpha, limit,
                        TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    slots, real, expert, past = _block_slots(sorted_slots_ptr, block_experts_ptr, num_padded_ptr, num_slots, BLOCK_M)
    if past:
        return
    tokens = tl.where(real, slots // TOP_K, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    gate_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    up_ptrs = gate_ptrs + N * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=real[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        gate += precise_dot(a, tl.load(gate_ptrs, mask=w_mask, other=0.0), UPCAST, IEEE)
        up += precise_dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), UPCAST, IEEE)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if HAS_BIAS:
        gate += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_ptr + expert * stride_be + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dtype = h_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)  # the GEMM's output in the model dtype, as the reference's
    up = up.to(dtype).to(tl.float32)
    if ACT == 1:  # gpt-oss: clamped, (up + 1) * gate * sigmoid(alpha * gate)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    else:
        h = gate / (1.0 + tl.exp(-gate)) * up
    h_ptrs = h_ptr + slots[:, None].to(tl.int64) * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(dtype), mask=real[:, None] & n_mask[None, :])


@triton.jit
def _down_weighted_kernel(h_ptr, w_ptr, b_ptr, weights_ptr, out_ptr, sorted_slots_ptr, block_experts_ptr,
                          num_padded_ptr, num_slots, N, K, stride_hm, stride_we, stride_wn, stride_be, stride_om,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    slots, real, expert, past = _block_slots(sorted_slots_ptr, block_experts_ptr, num_padded_ptr, num_slots, BLOCK_M)
    if past:
        return
    rows = tl.where(real, slots, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(h_ptrs, mask=real[:, None] & k_mask[None, :], other=0.0)
        acc += precise_dot(a, tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0), UPCAST, IEEE)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=real, other=0.0).to(tl.float32)
    out = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], out.to(dtype), mask=real[:, None] & n_mask[None, :])


def gate_up_act(x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor | None, aligned, top_k: int, block: tuple,
                activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """h [T * k, I] of every slot: act(gate, up) of its token under its expert (aligned: align_slots' result)."""
    sorted_slots, block_experts, num_padded = aligned
    block_m, block_n, block_k, warps, stages = block
    num_slots, inter, hidden = x.shape[0] * top_k, w13.shape[1] // 2, w13.shape[2]
    h = out if out is not None else torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    grid = (sorted_slots.numel() // block_m, triton.cdiv(inter, block_n))
    _gate_up_act_kernel[grid](
        x, w13, b13 if b13 is not None else w13, h, sorted_slots, block_experts, num_padded, num_slots, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), b13.stride(0) if b13 is not None else 0, h.stride(0),
        float(alpha), float(limit), TOP_K=top_k, ACT=ACTS[activation], HAS_BIAS=b13 is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast_dot(x), IEEE=x.dtype == torch.float32, num_warps=warps,
        num_stages=stages)
    return h


def down_weighted(h: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | None, weights: torch.Tensor, aligned,
                  block: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
    """[T * k, H]: each slot's down projection (plus bias) times its routing weight."""
    sorted_slots, block_experts, num_padded = aligned
    block_m, block_n, block_k, warps, stages = block
    num_slots, hidden, inter = h.shape[0], w2.shape[1], w2.shape[2]
    out = out if out is not None else torch.empty(num_slots, hidden, dtype=h.dtype, device=h.device)
    weights = weights.reshape(-1).float()
    grid = (sorted_slots.numel() // block_m, triton.cdiv(hidden, block_n))
    _down_weighted_kernel[grid](
        h, w2, b2 if b2 is not None else w2, weights, out, sorted_slots, block_experts, num_padded, num_slots, hidden,
        inter, h.stride(0), w2.stride(0), w2.stride(1), b2.stride(0) if b2 is not None else 0, out.stride(0),
        HAS_BIAS=b2 is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast_dot(h),
        IEEE=h.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, activation: str = "silu",
                  alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """sum_k weights[:, k] * expert_{experts[:, k]}(x), as engine/layers/moe.py experts_reference: x [T, H],
    w13 [E, 2I, H], w2 [E, H, I], weights and experts [T, k]."""
    num_tokens, top_k = experts.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    block = block_sizes(num_tokens * top_k, w13.shape[0])
    aligned = align_slots(experts, w13.shape[0], block[0])
    h = gate_up_act(x, w13, b13, aligned, top_k, block, activation, alpha, limit)
    out = down_weighted(h, w2, b2, weights, aligned, block)
    return out.view(num_tokens, top_k, -1).sum(dim=1) if top_k > 1 else out
