"""Triton kernels for the engine: paged KV-cache writes and paged attention (prefill and decode)."""
from engine.kernels.kv_store import store_kvcache
from engine.kernels.paged_decode import DecodeConfig, choose_num_splits, paged_decode
from engine.kernels.paged_prefill import PrefillConfig, paged_prefill

__all__ = ["store_kvcache", "paged_prefill", "paged_decode", "choose_num_splits",
           "PrefillConfig", "DecodeConfig"]
