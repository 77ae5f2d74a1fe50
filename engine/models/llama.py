"""The Llama decoder family: Llama, and through small flags Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral and
Phi-3 (a sliding window on every layer).

Pre-norm transformer: x → RMSNorm → attention (rotary, GQA) → + x → RMSNorm → SwiGLU MLP → + x.

Under tensor parallelism the attention's and the MLP's output projections leave each rank's part
unsummed; the norm that follows sums the parts, adds the residual and normalises in one step.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import ForwardContext
from engine.layers.attention import Attention, layer_type_windows
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.fusion import takes_gemv
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.parallel import TPGroup, divide
from engine.layers.rotary import RotaryEmbedding, rope_settings


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, cfg, family: "FamilyFlags", tp: TPGroup, ctx: ForwardContext, rotary: RotaryEmbedding,
                 window: int):
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        self.num_heads = divide(cfg.num_attention_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = divide(cfg.num_key_value_heads, tp.size, "num_key_value_heads")
        bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=bias or family.qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=bias, tp=tp,
                                        reduce_results=False)
        self.rotary_emb = rotary
        if family.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = family.qk_norm
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, ctx,
                              window=window)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention over the packed q/k/v rows (qkv_proj's output, which the layer computes with its
        norm), then the output projection."""
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        # the decode kernel can then start before the GEMV ends (not where a LoRA product is added after it)
        after_gemv = takes_gemv(qkv, self.qkv_proj.weight) and not self.qkv_proj.lora_active
        return self.o_proj(self.attn(qkv, positions, self.rotary_emb, q_norm, k_norm, after_gemv))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, family: "FamilyFlags", tp: TPGroup, ctx: ForwardContext, rotary: RotaryEmbedding,
                 window: int, mlp: nn.Module):
        """mlp: a GatedMLP, or a block that takes the normed rows whole (a mixture of experts)."""
        super().__init__()
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        self.self_attn = DecoderAttention(cfg, family, tp, ctx, rotary, window)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp)

    def forward(self, positions, x, residual):
        # each norm goes with the projection after it (fused into it where the GEMV runs: decode batches);
        # the first layer has no residual yet: its norm is of x alone, and x becomes the residual
        qkv, residual = self.input_layernorm.linear(x, residual, self.self_attn.qkv_proj)
        x = self.self_attn(positions, qkv)
        if not isinstance(self.mlp, GatedMLP):  # its output is this rank's part, like down_proj's
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        if self.mlp.activates_in_gate_up(x):  # SiLU·mul in the gate/up GEMM's epilogue: one kernel less
            act, residual = self.post_attention_layernorm.linear(x, residual, self.mlp.gate_up_proj, gated=True)
            return self.mlp.down_proj(act), residual
        gate_up, residual = self.post_attention_layernorm.linear(x, residual, self.mlp.gate_up_proj)
        return self.mlp(gate_up), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg, family: "FamilyFlags", tp: TPGroup, ctx: ForwardContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(head_dim_of(cfg), cfg.max_position_embeddings, *rope_settings(cfg))
        self.layers = nn.ModuleList(DecoderLayer(cfg, family, tp, ctx, self.rotary_emb, window,
                                                 family.layer_mlp(cfg, tp, index))
                                    for index, window in enumerate(family.layer_windows(cfg)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp)
        self.ctx = ctx

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ctx.prepare()  # what every layer's attention reads, first
        return self.run_layers(self.embed_tokens(input_ids), positions)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The decoder layers and the final norm over the input embeddings x."""
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class FamilyFlags:
    qkv_bias = False
    qk_norm = False
    # each layer's sliding window (0: the whole context): Llama's config has no layer_types (all global);
    # Qwen2's and Qwen3's mark sliding layers where use_sliding_window is on
    layer_windows = staticmethod(layer_type_windows)

    @staticmethod
    def layer_mlp(cfg, tp: TPGroup, layer_index: int) -> nn.Module:
        """The MLP of one layer (the MoE families choose per layer)."""
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"), tp)


class LlamaForCausalLM(nn.Module):
    flags = FamilyFlags
    # checkpoint name → (our packed parameter, which part of it)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, tp: TPGroup, ctx: ForwardContext):
        super().__init__()
        self.model = DecoderModel(cfg, self.flags, tp, ctx)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def layer_windows(cls, cfg) -> list[int]:
        """Each layer's sliding window, 0 for the whole context."""
        return cls.flags.layer_windows(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
