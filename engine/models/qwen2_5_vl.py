"""Qwen2.5-VL (Bai et al., 2025): a ViT whose image embeddings replace the image placeholder tokens of a
Qwen2 decoder that rotates with M-RoPE.

Vision tower, over an image's patches (temporal_patch x patch x patch pixels of 3 channels each):

    x = patch_embed(pixels)                       (a linear map of each patch: Conv3d with stride = kernel)
    patches reordered window by window (windows of window_size pixels, in units of 2 x 2 merged patches)
    x = x + attn(norm1(x)); x = x + SwiGLU(norm2(x))          (depth blocks, biases on every projection)
        attention is non-causal within one window, or within one image in the fullatt_block_indexes blocks;
        2-D rotary: the first quarter of each head's frequencies rotate by the patch's row, the next by
        its column
    merger: RMSNorm, then each 2 x 2 group of neighbouring patches (consecutive rows here) concatenated,
        Linear, GELU, Linear to the decoder's width; the window order undone.

Decoder: Qwen2's (qkv bias, SwiGLU, RMSNorm). M-RoPE splits each head's rotary frequencies into
mrope_section parts rotated by the temporal, height and width position streams (engine/inputs/multimodal.py);
where the three are equal (text, and every token after the prompt) it is plain rotary at that position.
So a step with no image token in it runs exactly the text decoder (positions + mrope_position_delta), and
a step that has image tokens gets per-token cos/sin tables built for its rows.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import ForwardContext
from engine.layers.embed_head import ParallelLMHead
from engine.layers.linear import ColumnParallelLinear, ReplicatedLinear
from engine.layers.parallel import TPGroup
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import DecoderModel
from engine.models.qwen import Qwen2Flags


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=False)
        self.proj.weight.requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = ReplicatedLinear(dim, 3 * dim, bias=True)
        self.proj = ReplicatedLinear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate_float(q, cos, sin), _rotate_float(k, cos, sin)
        return self.proj(segment_attention(q, k, v, segments).flatten(1))


def _rotate_float(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over the two halves of the head in float32 (cos/sin: [T, D / 2]), cast back."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def segment_attention(q, k, v, segments: dict[int, torch.Tensor]) -> torch.Tensor:
    """Non-causal attention within segments of rows. segments: length -> [S, length] row indices of the
    segments of that length (one batched attention per length). q, k, v: [T, H, D]."""
    out = torch.empty_like(q)
    for length, rows in segments.items():
        def gather(t):
            return t[rows].transpose(1, 2)  # [S, H, length, D]
        o = F.scaled_dot_product_attention(gather(q), gather(k), gather(v))
        out[rows.reshape(-1)] = o.transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


def _segments(lengths: list[int], device: torch.device) -> dict[int, torch.Tensor]:
    """Row indices of consecutive segments of the given lengths, grouped by length."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    by_length: dict[int, list[int]] = {}
    for s, n in zip(starts.tolist(), lengths):
        if n:
            by_length.setdefault(n, []).append(s)
    return {n: (torch.tensor(s, dtype=torch.int64)[:, None] + torch.arange(n)).to(device)
            for n, s in by_length.items()}


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(dim, [hidden, hidden], bias=True)
        self.down_proj = ReplicatedLinear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = VisionRMSNorm(cfg.hidden_size)
        self.norm2 = VisionRMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int):
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = VisionRMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))
        self.mlp.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"vision hidden_act {cfg.hidden_act!r} is not supported; supported: silu")
        self.merge = cfg.spatial_merge_size
        self.window = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size  # in merged patches
        self.full_blocks = set(cfg.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(cfg)
        head_dim = cfg.hidden_size // cfg.num_heads
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        spatial = head_dim // 2  # half the frequencies rotate by the row, half by the column
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial),
                             persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg.out_hidden_size, cfg.hidden_size, cfg.spatial_merge_size)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Embeddings [sum of t*h*w / merge^2, out_hidden_size] of the images' patches (their rows in order)."""
        order, window_lengths = self._window_order(grids)
        unit = self.merge * self.merge
        device = pixels.device
        rows = (torch.from_numpy(order)[:, None] * unit + torch.arange(unit)).reshape(-1).to(device)
        x = self.patch_embed(pixels)[rows]
        row_col = self._rotary_positions(grids).to(device)[rows].float()
        angles = torch.cat([row_col[:, :1] * self.inv_freq, row_col[:, 1:] * self.inv_freq], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        windows = _segments([n * unit for n in window_lengths], device)
        full = _segments([t_h_w for t, h, w in grids for t_h_w in [h * w] * t], device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in self.full_blocks else windows)
        merged = self.merger(x)
        return merged[torch.from_numpy(np.argsort(order)).to(device)]

    def _rotary_positions(self, grids) -> torch.Tensor:
        """[patches, 2] (row, column) of each patch, patches in merge-block order (as the processor lays them)."""
        m, out = self.merge, []
        for t, h, w in grids:
            hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
            block = (h // m, m, w // m, m)
            hw = np.stack([hh.reshape(block).transpose(0, 2, 1, 3).ravel(),
                           ww.reshape(block).transpose(0, 2, 1, 3).ravel()], axis=1)
            out.append(np.tile(hw, (t, 1)))
        return torch.from_numpy(np.concatenate(out))

    def _window_order(self, grids) -> tuple[np.ndarray, list[int]]:
        """The merged patches window by window (each window's in row order), and each window's size."""
        order, lengths, base, ws = [], [], 0, self.window
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            index = np.arange(t * gh * gw).reshape(t, gh, gw) + base
            for f in range(t):
                for r in range(0, gh, ws):
                    for c in range(0, gw, ws):
                        win = index[f, r:r + ws, c:c + ws].ravel()
                        order.append(win)
                        lengths.append(len(win))
            base += t * gh * gw
        return np.concatenate(order), lengths


class MRotaryEmbedding(RotaryEmbedding):
    """The decoder's rotary tables, and per-step tables for rows whose three position streams differ."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict, section: list[int]):
        super().__init__(head_dim, max_position, theta, scaling)
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} must add up to head_dim / 2 = {head_dim // 2}")
        # the position stream (0 temporal, 1 height, 2 width) that rotates each frequency
        self.register_buffer("stream", torch.tensor([i % 3 for i, n in enumerate(section) for _ in range(n)]),
                             persistent=False)

    @contextmanager
    def step_tables(self, positions3: torch.Tensor):
        """Within: cos/sin are this step's own tables, one row per token (index them by row number)."""
        table_cos, table_sin = self.cos, self.sin
        cols = torch.arange(self.stream.shape[0], device=positions3.device)
        rows = positions3[self.stream]  # [D / 2, T]: each frequency's stream's positions
        self.cos = table_cos[rows, cols[:, None]].T.contiguous()
        self.sin = table_sin[rows, cols[:, None]].T.contiguous()
        try:
            yield torch.arange(positions3.shape[1], device=positions3.device)
        finally:
            self.cos, self.sin = table_cos, table_sin


class MRopeDecoderModel(DecoderModel):
    def __init__(self, cfg, family, tp: TPGroup, ctx: ForwardContext):
        super().__init__(cfg, family, tp, ctx)
        head_dim = self.rotary_emb.cos.shape[1] * 2
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        section = list(rope.get("mrope_section") or [16, 24, 24])
        theta = float(rope.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)
        if rope.get("rope_type", "default") not in ("default", "mrope"):
            raise ValueError(f"rope type {rope.get('rope_type')!r} is not supported with M-RoPE")
        self.rotary_emb = MRotaryEmbedding(head_dim, cfg.max_position_embeddings, theta, {"rope_type": "default"},
                                           section)
        for layer in self.layers:
            layer.self_attn.rotary_emb = self.rotary_emb

    def forward(self, input_ids, positions, image_embeds=None, image_rows=None, mrope_positions=None):
        self.ctx.prepare()
        x = self.embed_tokens(input_ids)
        if image_embeds is not None:
            x[image_rows] = image_embeds.to(x.dtype)
        if mrope_positions is None:
            return self.run_layers(x, positions)
        with self.rotary_emb.step_tables(mrope_positions) as rows:
            return self.run_layers(x, rows)


class Qwen2_5_VLForConditionalGeneration(nn.Module):
    flags = Qwen2Flags
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    uses_mrope = True
    # the layout transformers 4.52 to 4.57 saved: the decoder and the vision tower under "model."
    checkpoint_prefixes = {"model.language_model.": "model.", "model.visual.": "visual."}

    def __init__(self, cfg, tp: TPGroup, ctx: ForwardContext):
        super().__init__()
        text = cfg.get_text_config()
        self.model = MRopeDecoderModel(text, self.flags, tp, ctx)
        self.visual = VisionTransformer(cfg.vision_config)
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, tp)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False)
                                        or getattr(text, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def layer_windows(cls, cfg) -> list[int]:
        return cls.flags.layer_windows(cfg.get_text_config())

    def forward(self, input_ids, positions, **multimodal) -> torch.Tensor:
        """multimodal (a step with image tokens): image_embeds placed at rows image_rows, mrope_positions
        [3, T]; without, a text step (positions already include each sequence's mrope_position_delta)."""
        return self.model(input_ids, positions, **multimodal)

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.visual(pixels, grids)

    def dummy_images(self, num_tokens: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """Pixels and grids of square images (256 tokens each) with about num_tokens tokens in all: what the
        model runner profiles the vision tower's activation memory with."""
        cfg, side = self.visual.config, 32  # patches a side: 16 x 16 merged tokens
        grids = [(1, side, side)] * max(1, num_tokens // (side * side // cfg.spatial_merge_size ** 2))
        width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        return torch.zeros(len(grids) * side * side, width), grids

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
