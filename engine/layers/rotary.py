"""Rotary position embedding, with the rope scalings the supported families use."""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.layers.fusion import rotate

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_settings(hf_config) -> tuple[float, dict]:
    """(theta, scaling) from a config that uses rope_parameters (new) or rope_theta/rope_scaling (old)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = dict(getattr(hf_config, "rope_scaling", None) or {})
    scaling = {**legacy, **params}
    theta = scaling.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    scaling["rope_type"] = rope_type
    return float(theta), scaling


def _inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict):
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, Hkv, D]; rotates the two halves of D."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return rotate(q, cos, sin), rotate(k, cos, sin)
