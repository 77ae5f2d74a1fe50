"""Rotary position embedding, with the rope scalings the supported families use."""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.layers.fusion import rotate

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rope_settings(hf_config, layer_type: str | None = None) -> tuple[float, dict]:
    """(theta, scaling) from a config that uses rope_parameters (new) or rope_theta/rope_scaling (old);
    layer_type: the parameters of that kind of layer where the config keeps one set per kind (Gemma 3's
    "sliding_attention" and "full_attention")."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    legacy = dict(getattr(hf_config, "rope_scaling", None) or {})
    scaling = {**legacy, **params}
    theta = scaling.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    if rope_type in ("su", "yarn") and "long_factor" in scaling:  # Phi-3's older names of longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = scaling.pop("partial_rotary_factor", None) or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    scaling["rope_type"] = rope_type
    if rope_type in ("longrope", "yarn"):
        scaling.setdefault("original_max_position_embeddings",
                           getattr(hf_config, "original_max_position_embeddings", None)
                           or hf_config.max_position_embeddings)
    return float(theta), scaling


def long_rope_rows(hf_config) -> tuple[int, int] | None:
    """LongRoPE: (the context length past which a sequence rotates with the long factors, the row of position 0
    in the long half of RotaryEmbedding's tables); None for a rope of one set of frequencies."""
    given = {**dict(getattr(hf_config, "rope_scaling", None) or {}),
             **dict(getattr(hf_config, "rope_parameters", None) or {})}
    if "long_factor" not in given:  # (a config of several ropes, or M-RoPE's, has none at its top)
        return None
    _, scaling = rope_settings(hf_config)
    return scaling["original_max_position_embeddings"], hf_config.max_position_embeddings


def _inv_freq(head_dim: int, theta: float, scaling: dict, factors: list[float] | None = None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if factors is not None:  # longrope: each frequency divided by its own factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
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


def _yarn(head_dim: int, theta: float, scaling: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023) as transformers computes it: (inverse frequencies, cos/sin scale). Frequencies that
    turn fewer than beta_slow times over original_max_position_embeddings are interpolated (divided by factor),
    those that turn more than beta_fast times kept, a linear ramp between; cos and sin are scaled by
    attention_factor, by default 0.1 ln(factor) + 1 (or DeepSeek's mscale ratio)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    wavelength_scale = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kept = 1 - ramp  # the share of each frequency left as it was (extrapolated)
    return 1.0 / (factor * wavelength_scale) * (1 - kept) + 1.0 / wavelength_scale * kept, float(attention_factor)


def _tables(inv_freq: torch.Tensor, max_position: int, attention_factor: float = 1.0):
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


class RotaryEmbedding(nn.Module):
    """cos/sin tables [rows, head_dim / 2] (float32) indexed by position, shared by the layers that use one
    rope. YaRN (gpt-oss) rescales the frequencies and the tables once (_yarn). LongRoPE (Phi-3's long-context
    checkpoints) keeps two sets of frequencies, the long set in the table's second half: a token's row is its
    position, or its position + max_position where its sequence rotates with the long factors. The engine
    chooses (long_rope_rows): a sequence longer than original_max_position_embeddings takes the long factors for
    all its tokens, and one that grows past it is computed anew, as transformers' Phi-3 does."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict):
        super().__init__()
        if scaling["rope_type"] == "longrope":
            original = scaling["original_max_position_embeddings"]
            factor = scaling.get("factor") or max_position / original
            attention_factor = scaling.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
            short, long = (_tables(_inv_freq(head_dim, theta, scaling, scaling[factors]), max_position, attention_factor)
                           for factors in ("short_factor", "long_factor"))
            cos, sin = torch.cat([short[0], long[0]]), torch.cat([short[1], long[1]])
        elif scaling["rope_type"] == "yarn":
            inv_freq, attention_factor = _yarn(head_dim, theta, scaling, max_position)
            cos, sin = _tables(inv_freq, max_position, attention_factor)
        else:
            cos, sin = _tables(_inv_freq(head_dim, theta, scaling), max_position)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, Hkv, D]; rotates the two halves of D. positions: table rows (see the class)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return rotate(q, cos, sin), rotate(k, cos, sin)
