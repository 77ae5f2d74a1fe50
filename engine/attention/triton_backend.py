"""The `triton` attention backend: the engine's own kernels (engine/kernels), default on CUDA."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from engine.kernels import fused_decode, gemv, paged_decode, paged_prefill, qkv_prep, store_kvcache
from engine.kernels.launch import pdl_setting
from engine.kernels.paged_decode import SCHEDULES as DECODE_SCHEDULES
from engine.kernels.paged_decode import decode_order, plan_decode

if TYPE_CHECKING:
    from engine.attention import AttentionMetadata


class TritonBackend:
    """Paged attention through Triton: split-KV decode, varlen chunked prefill, GQA-packed heads."""

    name = "triton"
    supports_cuda_graphs = True  # decode sizes its grid and scratch from Python ints only

    def __init__(self):
        # REDLINE_FUSED_QKV=0 keeps the unfused layers (norm, rotary, store) for comparison
        self.fuses_qkv_prep = os.environ.get("REDLINE_FUSED_QKV", "1") != "0"
        # REDLINE_DECODE_SCHEDULE: "grid" or "balanced" (equal chunks from a per-step plan)
        self.decode_schedule = os.environ.get("REDLINE_DECODE_SCHEDULE", "grid")
        if self.decode_schedule not in DECODE_SCHEDULES:
            raise ValueError(f"REDLINE_DECODE_SCHEDULE={self.decode_schedule!r}; use one of {DECODE_SCHEDULES}")
        # REDLINE_DECODE_ORDER=0 starts decode programs in batch order instead of longest sequence first
        ordered = os.environ.get("REDLINE_DECODE_ORDER", "1")
        if ordered not in ("0", "1"):
            raise ValueError(f"REDLINE_DECODE_ORDER={ordered!r}; use 1 (longest sequence first) or 0")
        self.orders_decode = ordered == "1" and self.decode_schedule == "grid"
        # REDLINE_FUSED_DECODE=0 keeps qkv preparation, decode and the merge of its splits three kernels
        fused = os.environ.get("REDLINE_FUSED_DECODE", "1")
        if fused not in ("0", "1"):
            raise ValueError(f"REDLINE_FUSED_DECODE={fused!r}; use 1 (one kernel) or 0")
        self.fuses_decode = fused == "1" and self.fuses_qkv_prep and self.decode_schedule == "grid"
        # fused decode's split counters, zero between launches; earlier, smaller sets stay alive for the
        # CUDA graphs that captured them
        self._counters: list[torch.Tensor] = []
        # REDLINE_PDL, REDLINE_GEMV_MAX_ROWS and REDLINE_EARLY_PAGE: bad values fail here, not mid-step
        pdl_setting(), gemv.max_rows(), fused_decode.early_page()

    def qkv_prep(self, qkv: torch.Tensor, positions: torch.Tensor, rotary, q_norm, k_norm,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """Queries [T, H, D] ready for attention; K/V stored. One kernel (engine/kernels/qkv_prep.py)."""
        return qkv_prep(qkv, positions, rotary.cos, rotary.sin, *_qk_norm_args(q_norm, k_norm), k_cache, v_cache,
                        slot_mapping, num_heads, num_kv_heads, head_dim)

    def decode_from_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary, q_norm, k_norm,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: "AttentionMetadata",
                        num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                        after_gemv: bool | None = None) -> torch.Tensor | None:
        """A decode batch's attention output [B, H, D] straight from the qkv rows, K/V stored: one kernel
        (engine/kernels/fused_decode.py); None where it does not apply (then qkv_prep and forward)."""
        if not (self.fuses_decode and meta.is_decode and fused_decode.fits(head_dim)):
            return None
        return fused_decode.fused_decode(
            qkv, positions, rotary.cos, rotary.sin, *_qk_norm_args(q_norm, k_norm), k_cache, v_cache,
            meta.slot_mapping, meta.seqlens_k, meta.block_tables, meta.max_seqlen_k, scale, num_heads,
            num_kv_heads, self._split_counters(qkv.shape[0] * num_kv_heads, qkv.device),
            order=self._decode_order(meta), after_gemv=after_gemv)

    def _split_counters(self, count: int, device: torch.device) -> torch.Tensor:
        if not self._counters or self._counters[-1].numel() < count or self._counters[-1].device != device:
            self._counters.append(torch.zeros(max(count, 1024), dtype=torch.int32, device=device))
        return self._counters[-1]

    def store_kvcache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def prepare(self, meta: "AttentionMetadata") -> None:
        """Before a forward pass's first kernel: sort the decode order now. The fused decode kernel reads it
        before its wait where the GEMV precedes it, so no kernel just before it may write the order."""
        self._decode_order(meta)

    def _decode_order(self, meta: "AttentionMetadata") -> torch.Tensor | None:
        """The batch's sequences longest first, sorted on the device once a forward pass (by prepare, or
        the first layer; inside a CUDA graph being captured, the sort is captured with it) and kept for
        the others."""
        if (self.orders_decode and meta.decode_order is None and meta.seqlens_k.shape[0] > 1
                and meta.has_decode_rows):
            meta.decode_order = decode_order(meta.seqlens_k)
        return meta.decode_order

    def _decode_plan(self, meta: "AttentionMetadata", num_kv_heads: int):
        """The balanced schedule's chunk table, written by the first layer of a forward pass (captured
        with the decode graphs like the order) and read by the others."""
        if self.decode_schedule == "balanced" and meta.decode_plan is None:
            meta.decode_plan = plan_decode(meta.seqlens_k, num_kv_heads, meta.max_seqlen_k,
                                           None if meta.is_decode else meta.cu_seqlens_q)
        return meta.decode_plan

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: "AttentionMetadata", scale: float) -> torch.Tensor:
        if meta.is_decode:
            return paged_decode(q, k_cache, v_cache, meta.seqlens_k, meta.block_tables, meta.max_seqlen_k, scale,
                                schedule=self.decode_schedule, order=self._decode_order(meta),
                                plan=self._decode_plan(meta, k_cache.shape[2]))
        # chunks through the prefill kernel; one-token rows of a mixed batch through split-KV decode
        out = paged_prefill(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seqlens_k,
                            meta.block_tables, meta.max_seqlen_q, scale, skip_decodes=True)
        if not meta.has_decode_rows:  # a prefill-only step: no decode launches (their host time is the cost)
            return out
        order = self._decode_order(meta)
        plan = self._decode_plan(meta, k_cache.shape[2])
        return paged_decode(q, k_cache, v_cache, meta.seqlens_k, meta.block_tables, meta.max_seqlen_k,
                            scale, out=out, cu_seqlens_q=meta.cu_seqlens_q, schedule=self.decode_schedule,
                            order=order, plan=plan)


def _qk_norm_args(q_norm, k_norm) -> tuple:
    """(q norm weight, k norm weight, eps) for the fused kernels: (None, None, 0.0) without q/k norm."""
    if q_norm is None:
        return None, None, 0.0
    if q_norm.eps != k_norm.eps:
        raise ValueError("the fused q/k norm needs one eps for both")
    return q_norm.weight, k_norm.weight, q_norm.eps
