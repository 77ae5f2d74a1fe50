"""Triton kernels for the engine: qkv preparation and paged KV-cache writes, paged attention (prefill and decode)."""
from engine.kernels.kv_store import store_kvcache
from engine.kernels.paged_decode import DecodeConfig, choose_num_splits, paged_decode
from engine.kernels.paged_prefill import PrefillConfig, paged_prefill
from engine.kernels.qkv_prep import qkv_prep

__all__ = ["store_kvcache", "qkv_prep", "paged_prefill", "paged_decode", "choose_num_splits",
           "PrefillConfig", "DecodeConfig"]
