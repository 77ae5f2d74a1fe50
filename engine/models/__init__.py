"""Model classes by the `architectures` name in config.json."""
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(architectures: list[str] | None):
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported architecture {architectures}; supported: {', '.join(MODEL_REGISTRY)}")
