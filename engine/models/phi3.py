"""Phi-3 (Abdin et al., 2024): the Llama decoder as Microsoft packs it.

- The checkpoint holds the attention's projection as one qkv_proj ([q | k | v] rows) and the MLP's as one
  gate_up_proj ([gate | up] rows): the engine's own packed projections, loaded whole.
- Every layer attends through config.sliding_window (Phi-3-mini-4k: 2047), where it is set.
- The long-context checkpoints (128k) rotate with LongRoPE: per-frequency short and long factors, the long
  ones for sequences longer than original_max_position_embeddings, cos and sin scaled by
  sqrt(1 + ln(s) / ln(original)) for s = max_position_embeddings / original (layers/rotary.py).
"""
from engine.layers.attention import every_layer_window
from engine.models.llama import FamilyFlags, LlamaForCausalLM


class Phi3Flags(FamilyFlags):
    layer_windows = staticmethod(every_layer_window)


class Phi3ForCausalLM(LlamaForCausalLM):
    flags = Phi3Flags
    packed_modules = {}  # qkv_proj and gate_up_proj are the checkpoint's own names
