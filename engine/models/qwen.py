"""Qwen2 and Qwen3: the Llama decoder with qkv bias (Qwen2) or per-head q/k RMSNorm (Qwen3)."""
from engine.models.llama import FamilyFlags, LlamaForCausalLM


class Qwen2Flags(FamilyFlags):
    qkv_bias = True


class Qwen3Flags(FamilyFlags):
    qk_norm = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    flags = Qwen2Flags


class Qwen3ForCausalLM(LlamaForCausalLM):
    flags = Qwen3Flags
