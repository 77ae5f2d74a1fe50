"""gpt-oss (OpenAI, 2025): a pre-norm mixture-of-experts decoder whose attention keeps a sink per head.

    h = h + o_proj(attention(rope(q), rope(k), v, sinks))       (input norm before; q/k/v/o with biases)
    h = h + moe(post_attention_norm(h))
    logits = lm_head(norm(h))

- Attention: GQA with head_dim 64, softmax scale head_dim^-1/2; each query head has a learned logit, its sink,
  that joins the softmax's denominator and carries no value. config.layer_types alternates sliding-window
  layers (config.sliding_window: a query at position i sees keys j with i - j < window) and full ones.
- Rope: YaRN (layers/rotary.py), cos and sin scaled by its attention factor.
- MoE: a router with a bias takes each token's top-k experts, their weights a softmax over the top-k logits;
  each expert (biases on both projections) applies the clamped SwiGLU: gate clamped above at swiglu_limit,
  up to [-limit, limit], then (up + 1) * gate * sigmoid(swiglu_alpha * gate) (layers/moe.py).

The checkpoint stores each layer's experts fused: gate_up_proj [E, H, 2I] with gate and up in alternate columns
(and its bias [E, 2I] alike), down_proj [E, I, H] and its bias [E, H]; the router as mlp.router. OpenAI's
published checkpoints hold the experts in MXFP4 (a quantization_config): they load as published, packed
(engine/layers/quant/mxfp4.py).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from engine.attention import ForwardContext
from engine.layers.attention import Attention, layer_type_windows
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.fusion import takes_gemv
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.moe import FusedMoE
from engine.layers.norm import RMSNorm
from engine.layers.parallel import TPGroup, divide
from engine.layers.rotary import RotaryEmbedding, rope_settings


def head_parameter(num_heads: int, tp: TPGroup) -> nn.Parameter:
    """One value per query head, this rank's heads of them (the attention sinks)."""
    local = divide(num_heads, tp.size, "num_attention_heads")
    param = nn.Parameter(torch.empty(local), requires_grad=False)
    param.full_shape = (num_heads,)

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.narrow(0, tp.rank * local, local))

    param.weight_loader = param.load_full = load
    return param


class GptOssAttention(nn.Module):
    def __init__(self, cfg, tp: TPGroup, ctx: ForwardContext, rotary: RotaryEmbedding, window: int):
        super().__init__()
        head_dim = cfg.head_dim
        num_heads = divide(cfg.num_attention_heads, tp.size, "num_attention_heads")
        num_kv_heads = divide(cfg.num_key_value_heads, tp.size, "num_key_value_heads")
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias, tp=tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * head_dim, cfg.hidden_size, bias=cfg.attention_bias,
                                        tp=tp, reduce_results=False)
        self.sinks = head_parameter(cfg.num_attention_heads, tp)
        self.rotary_emb = rotary
        self.attn = Attention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, ctx, window=window)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention with sinks over the packed q/k/v rows (computed with the input norm), then the output
        projection (this rank's part, summed by the norm after it)."""
        after_gemv = takes_gemv(qkv, self.qkv_proj.weight)
        return self.o_proj(self.attn(qkv, positions, self.rotary_emb, None, None, after_gemv, sinks=self.sinks))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg, tp: TPGroup, ctx: ForwardContext, rotary: RotaryEmbedding, window: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp)
        self.self_attn = GptOssAttention(cfg, tp, ctx, rotary, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp)
        alpha = getattr(cfg, "swiglu_alpha", 1.702)  # configs of transformers before it was a field: always 1.702
        self.mlp = FusedMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok,
                            tp, renormalize=True, activation="swiglu_clamped", expert_bias=True, router_bias=True,
                            swiglu_alpha=alpha, swiglu_limit=cfg.swiglu_limit)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        """(x, residual) in, as the Llama decoder carries them; (this rank's MoE output, the stream) out."""
        qkv, residual = self.input_layernorm.linear(x, residual, self.self_attn.qkv_proj)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, qkv), residual)
        return self.mlp(x), residual


class GptOssModel(nn.Module):
    def __init__(self, cfg, tp: TPGroup, ctx: ForwardContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, *rope_settings(cfg))
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, tp, ctx, self.rotary_emb, window)
                                    for window in layer_type_windows(cfg))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp)
        self.ctx = ctx

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ctx.prepare()  # what every layer's attention reads, first
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


# the fused expert tensors of a checkpoint layer → (our parameter, ExpertWeights part)
_EXPERTS = re.compile(r"^(?P<layer>.+\.mlp)\.experts\.(?P<name>(gate_up|down)_proj(_bias|_blocks|_scales)?)$")
_EXPERT_PARTS = {"gate_up_proj": ("w13", "gate_up_interleaved_t"),
                 "gate_up_proj_bias": ("b13", "gate_up_interleaved_t"),
                 "down_proj": ("w2", "down_t"), "down_proj_bias": ("b2", "down"),
                 # MXFP4 (engine/layers/quant/mxfp4.py loads them)
                 "gate_up_proj_blocks": ("w13_blocks", "gate_up"), "gate_up_proj_scales": ("w13_scales", "gate_up"),
                 "down_proj_blocks": ("w2_blocks", "down"), "down_proj_scales": ("w2_scales", "down")}


class GptOssForCausalLM(nn.Module):
    attention_sinks = True  # the attention backend must take them (engine.attention.get_backend)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(self, cfg, tp: TPGroup, ctx: ForwardContext):
        super().__init__()
        self.model = GptOssModel(cfg, tp, ctx)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def checkpoint_target(name: str) -> tuple[str, object] | None:
        """Our parameter and shard id of a checkpoint tensor the packed names do not place: the fused experts
        and the router (our MoE's `gate`)."""
        match = _EXPERTS.match(name)
        if match is not None:
            param, part = _EXPERT_PARTS[match["name"]]
            return f"{match['layer']}.experts.{param}", (None, part)
        if ".mlp.router." in name:
            return name.replace(".mlp.router.", ".mlp.gate."), None
        return None

    @classmethod
    def layer_windows(cls, cfg) -> list[int]:
        """Each layer's sliding window, 0 for the whole context."""
        return layer_type_windows(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
