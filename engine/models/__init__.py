"""Model classes by the `architectures` name in config.json."""
from engine.models.gemma2 import Gemma2ForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mistral import MistralForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from engine.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    # the bare decoders, as sentence-transformers saves embedding models (no LM head unless tied)
    "LlamaModel": LlamaForCausalLM,
    "Qwen2Model": Qwen2ForCausalLM,
    "Qwen3Model": Qwen3ForCausalLM,
}


def model_class(architectures: list[str] | None):
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported architecture {architectures}; supported: {', '.join(MODEL_REGISTRY)}")
