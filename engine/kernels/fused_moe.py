"""The experts of a mixture-of-experts layer in two grouped GEMMs over every expert (engine/layers/moe.py).

`route_top_k`: each token's softmax over the router's logits, its k largest and their (renormalised) weights, in
one kernel. A token routed to k experts is k slots (slot s = token * k + j). The align step (`align_slots`)
groups the slots by expert and pads each expert's run to a multiple of BLOCK_M with a sentinel slot, so that
every block of BLOCK_M sorted slots belongs to one expert: a count of each expert's slots (atomics, which also
give each slot its place in its run), one program for the runs' starts and each block's expert, and the
slots placed. Then:

  gate_up_act: each program takes a block of slots and BLOCK_N columns of its expert's gate and up rows,
      h[slot] = act(x[token] @ gate.T + b_gate, x[token] @ up.T + b_up)        (one pass over x for both)
  down_weighted: out[slot] = (h[slot] @ down.T + b_down) * weight[slot]
  and the k slots of each token are summed (torch).

Everything runs on the device from tensors whose sizes come from shapes alone: no host sync, so decode steps
are captured in CUDA graphs. Blocks past the padded total (read from the device) return at once. Accumulates in
float32; h and the slot outputs are rounded to the model dtype, as the reference (engine/layers/moe.py
experts_reference) rounds between its GEMMs.

MXFP4 experts (gpt-oss as published; engine/layers/quant/mxfp4.py): w13 and w2 are the packed uint8 blocks (two
e2m1 values a byte, the even one in the low nibble) and `mxfp4_scales` their e8m0 scales, one per 32 values along
K. Each weight tile is dequantized in registers (value x 2^(scale - 127), exact in bf16) before its dot: the
experts' weights cross memory at 4.25 bits a value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import interpreted, precise_dot
from engine.kernels.paged_tiles import upcast_dot

ACTS = {"silu": 0, "swiglu_clamped": 1}
SLOTS_PER_PROGRAM = 1024  # of the align step's counting and placing kernels


def block_sizes(num_slots: int, num_experts: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). BLOCK_M follows the slots per expert: each block reads
    its expert's weights, so a decode step's few slots an expert fit one block where they can (256 sequences, top-8
    of 128 experts: 16 on average, up to about 30), and padding costs little there, where reading the weights is
    the time. Chosen from the shapes, not yet tuned on a GPU."""
    if interpreted():
        return 16, 32, 32, 4, 1
    per_expert = num_slots / num_experts
    block_m = 16 if per_expert <= 8 else 32 if per_expert <= 32 else 64
    return block_m, 64, 64, 4, 3


@triton.jit(do_not_specialize=["num_tokens"])  # one variant for every batch
def _route_kernel(logits_ptr, weights_ptr, experts_ptr, num_tokens, num_experts, stride_lm, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Each token's softmax over the experts, its TOP_K largest (ties to the lower expert) and their weights."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < num_tokens
    cols = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lm + cols[None, :],
                     mask=row_mask[:, None] & (cols[None, :] < num_experts), other=float("-inf")).to(tl.float32)
    logits = tl.where(row_mask[:, None], logits, 0.0)  # rows past the tokens: finite, never stored
    probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = probs / tl.sum(probs, axis=1)[:, None]
    total = tl.full((BLOCK_T,), 1.0, tl.float32)
    if RENORMALIZE:  # a first pass for the top-k's sum
        left, total = probs, tl.zeros((BLOCK_T,), tl.float32)
        for _ in tl.static_range(TOP_K):
            best = tl.argmax(left, axis=1, tie_break_left=True)
            total += tl.max(left, axis=1)
            left = tl.where(cols[None, :] == best[:, None], -1.0, left)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=1, tie_break_left=True)
        tl.store(weights_ptr + rows * TOP_K + j, tl.max(probs, axis=1) / total, mask=row_mask)
        tl.store(experts_ptr + rows * TOP_K + j, best.to(tl.int32), mask=row_mask)
        probs = tl.where(cols[None, :] == best[:, None], -1.0, probs)


def route_top_k(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, experts [T, k] int32), as engine/layers/moe.py route: one kernel."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, experts
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 4096 // block_e))
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, weights, experts, num_tokens, num_experts, logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_T=block_t, BLOCK_E=block_e)
    return weights, experts


@triton.jit(do_not_specialize=["num_slots"])
def _count_kernel(experts_ptr, counts_ptr, ranks_ptr, num_slots, BLOCK: tl.constexpr):
    """Each slot's place among its expert's slots (in no particular order: each slot's row is computed alone)."""
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = slots < num_slots
    expert = tl.load(experts_ptr + slots, mask=mask, other=0)
    tl.store(ranks_ptr + slots, tl.atomic_add(counts_ptr + expert, 1, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["num_blocks"])
def _runs_kernel(counts_ptr, run_start_ptr, block_experts_ptr, num_padded_ptr, num_experts, num_blocks,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """One program: each expert's run padded to BLOCK_M, where it starts, the padded total, each block's expert."""
    cols = tl.arange(0, BLOCK_E)
    col_mask = cols < num_experts
    counts = tl.load(counts_ptr + cols, mask=col_mask, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(run_start_ptr + cols, ends - padded, mask=col_mask)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for first in range(0, num_blocks, CHUNK):
        blocks = first + tl.arange(0, CHUNK)
        # the block's expert: how many runs end at or before its first position
        ended = (ends[None, :] <= blocks[:, None] * BLOCK_M) & col_mask[None, :]
        expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), num_experts - 1)
        tl.store(block_experts_ptr + blocks, expert, mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["num_slots"])
def _place_kernel(experts_ptr, ranks_ptr, run_start_ptr, sorted_slots_ptr, num_slots, BLOCK: tl.constexpr):
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = slots < num_slots
    expert = tl.load(experts_ptr + slots, mask=mask, other=0)
    place = tl.load(run_start_ptr + expert, mask=mask, other=0) + tl.load(ranks_ptr + slots, mask=mask, other=0)
    tl.store(sorted_slots_ptr + place, slots, mask=mask)


def align_slots(experts: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_slots [capacity] int32, block_experts [capacity / block_m] int32, num_padded [1] int32) of the routed
    experts [T, k]: slots grouped by expert, each expert's run padded to a multiple of block_m with the sentinel
    T * k; block b's expert; the padded total. Capacity bounds the total from the shapes alone. Four kernels."""
    num_slots = experts.numel()
    device = experts.device
    experts = experts.reshape(-1).to(torch.int32)
    used = min(num_experts, num_slots)  # experts with at least one slot, at most
    capacity = -(-(num_slots + used * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    ranks = torch.empty(num_slots, dtype=torch.int32, device=device)
    run_start = torch.empty(num_experts, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    block_experts = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    sorted_slots = torch.full((capacity,), num_slots, dtype=torch.int32, device=device)
    grid = (triton.cdiv(num_slots, SLOTS_PER_PROGRAM),)
    _count_kernel[grid](experts, counts, ranks, num_slots, BLOCK=SLOTS_PER_PROGRAM)
    _runs_kernel[(1,)](counts, run_start, block_experts, num_padded, num_experts, capacity // block_m,
                       BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=64)
    _place_kernel[grid](experts, ranks, run_start, sorted_slots, num_slots, BLOCK=SLOTS_PER_PROGRAM)
    return sorted_slots, block_experts, num_padded


@triton.jit
def _block_slots(sorted_slots_ptr, block_experts_ptr, num_padded_ptr, num_slots, BLOCK_M: tl.constexpr):
    """(the block's slots, which of them are real, its expert, whether the block is past the padded total)."""
    pid_m = tl.program_id(0)
    past = pid_m * BLOCK_M >= tl.load(num_padded_ptr)
    slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    return slots, slots < num_slots, expert, past


@triton.jit
def _mxfp4_tile(rows_ptr, scale_rows_ptr, k0, K, n_mask, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """[BLOCK_K, BLOCK_N] weights in dtype at input features k0.. of MXFP4 rows (rows_ptr, scale_rows_ptr [1, BLOCK_N]:
    each row's first byte and first scale): each byte and scale loaded once, the nibbles and the block scales
    spread over the tile in registers. BLOCK_K and K are multiples of 32."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    byte = tl.load(rows_ptr + offs_b[:, None], mask=(offs_b < K // 2)[:, None] & n_mask[None, :], other=0)
    nibble = (byte.to(tl.int32)[:, None, :] >> (tl.arange(0, 2) * 4)[None, :, None]) & 0xF  # [BLOCK_K / 2, 2, N]
    exponent = (nibble >> 1) & 3
    mantissa = (nibble & 1).to(tl.float32)
    value = tl.where(exponent == 0, mantissa * 0.5, (2.0 + mantissa) * tl.exp2((exponent - 2).to(tl.float32)))
    value = tl.reshape(tl.where(nibble >= 8, -value, value), (BLOCK_K, value.shape[2]))
    offs_s = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scale = tl.load(scale_rows_ptr + offs_s[:, None], mask=(offs_s < K // 32)[:, None] & n_mask[None, :], other=127)
    scale = tl.exp2(scale.to(tl.float32) - 127.0)
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (BLOCK_K // 32, 32, scale.shape[1])), value.shape)
    return (value * scale).to(dtype)


@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_act_kernel(x_ptr, w_ptr, b_ptr, h_ptr, sorted_slots_ptr, block_experts_ptr, num_padded_ptr,
                        num_slots, N, K, stride_xm, stride_we, stride_wn, stride_be, stride_hm, alpha, limit,
                        s_ptr, stride_se, stride_sn,
                        TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                        MXFP4: tl.constexpr):
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
        if MXFP4:  # packed rows: byte and scale pointers of each column's gate and up rows
            gate_rows = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
            gate_scales = s_ptr + expert * stride_se + offs_n[None, :].to(tl.int64) * stride_sn
            gate_w = _mxfp4_tile(gate_rows, gate_scales, k * BLOCK_K, K, n_mask, BLOCK_K, x_ptr.dtype.element_ty)
            up_w = _mxfp4_tile(gate_rows + N * stride_wn, gate_scales + N * stride_sn, k * BLOCK_K, K, n_mask,
                               BLOCK_K, x_ptr.dtype.element_ty)
        else:
            gate_w = tl.load(gate_ptrs, mask=w_mask, other=0.0)
            up_w = tl.load(up_ptrs, mask=w_mask, other=0.0)
        gate += precise_dot(a, gate_w, UPCAST, IEEE)
        up += precise_dot(a, up_w, UPCAST, IEEE)
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


@triton.jit(do_not_specialize=["num_slots"])
def _down_weighted_kernel(h_ptr, w_ptr, b_ptr, weights_ptr, out_ptr, sorted_slots_ptr, block_experts_ptr,
                          num_padded_ptr, num_slots, N, K, stride_hm, stride_we, stride_wn, stride_be, stride_om,
                          s_ptr, stride_se, stride_sn,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, MXFP4: tl.constexpr):
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
        w_mask = k_mask[:, None] & n_mask[None, :]
        if MXFP4:
            w = _mxfp4_tile(w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn,
                            s_ptr + expert * stride_se + offs_n[None, :].to(tl.int64) * stride_sn,
                            k * BLOCK_K, K, n_mask, BLOCK_K, h_ptr.dtype.element_ty)
        else:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc += precise_dot(a, w, UPCAST, IEEE)
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
                out: torch.Tensor | None = None, w13_scales: torch.Tensor | None = None) -> torch.Tensor:
    """h [T * k, I] of every slot: act(gate, up) of its token under its expert (aligned: align_slots' result).
    w13_scales: w13 is MXFP4 blocks [E, 2I, H / 2] with these scales [E, 2I, H / 32]."""
    sorted_slots, block_experts, num_padded = aligned
    block_m, block_n, block_k, warps, stages = block
    mxfp4 = w13_scales is not None
    num_slots, inter, hidden = x.shape[0] * top_k, w13.shape[1] // 2, x.shape[1]
    scales = w13_scales if mxfp4 else w13
    h = out if out is not None else torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    grid = (sorted_slots.numel() // block_m, triton.cdiv(inter, block_n))
    _gate_up_act_kernel[grid](
        x, w13, b13 if b13 is not None else w13, h, sorted_slots, block_experts, num_padded, num_slots, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), b13.stride(0) if b13 is not None else 0, h.stride(0),
        float(alpha), float(limit), scales, scales.stride(0), scales.stride(1), TOP_K=top_k, ACT=ACTS[activation],
        HAS_BIAS=b13 is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast_dot(x),
        IEEE=x.dtype == torch.float32, MXFP4=mxfp4, num_warps=warps, num_stages=stages)
    return h


def down_weighted(h: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | None, weights: torch.Tensor, aligned,
                  block: tuple, out: torch.Tensor | None = None, w2_scales: torch.Tensor | None = None) -> torch.Tensor:
    """[T * k, H]: each slot's down projection (plus bias) times its routing weight. w2_scales: w2 is MXFP4 blocks
    [E, H, I / 2] with these scales [E, H, I / 32]."""
    sorted_slots, block_experts, num_padded = aligned
    block_m, block_n, block_k, warps, stages = block
    mxfp4 = w2_scales is not None
    num_slots, hidden, inter = h.shape[0], w2.shape[1], h.shape[1]
    scales = w2_scales if mxfp4 else w2
    out = out if out is not None else torch.empty(num_slots, hidden, dtype=h.dtype, device=h.device)
    weights = weights.reshape(-1).float()
    grid = (sorted_slots.numel() // block_m, triton.cdiv(hidden, block_n))
    _down_weighted_kernel[grid](
        h, w2, b2 if b2 is not None else w2, weights, out, sorted_slots, block_experts, num_padded, num_slots, hidden,
        inter, h.stride(0), w2.stride(0), w2.stride(1), b2.stride(0) if b2 is not None else 0, out.stride(0),
        scales, scales.stride(0), scales.stride(1), HAS_BIAS=b2 is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, UPCAST=upcast_dot(h), IEEE=h.dtype == torch.float32, MXFP4=mxfp4, num_warps=warps,
        num_stages=stages)
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, activation: str = "silu",
                  alpha: float = 1.702, limit: float = 7.0, mxfp4_scales: tuple | None = None) -> torch.Tensor:
    """sum_k weights[:, k] * expert_{experts[:, k]}(x), as engine/layers/moe.py experts_reference: x [T, H],
    w13 [E, 2I, H], w2 [E, H, I], weights and experts [T, k]. mxfp4_scales (w13's, w2's): w13 and w2 are MXFP4
    blocks (see the module's docstring)."""
    num_tokens, top_k = experts.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    block = block_sizes(num_tokens * top_k, w13.shape[0])
    aligned = align_slots(experts, w13.shape[0], block[0])
    w13_scales, w2_scales = mxfp4_scales or (None, None)
    h = gate_up_act(x, w13, b13, aligned, top_k, block, activation, alpha, limit, w13_scales=w13_scales)
    out = down_weighted(h, w2, b2, weights, aligned, block, w2_scales=w2_scales)
    return out.view(num_tokens, top_k, -1).sum(dim=1) if top_k > 1 else out
