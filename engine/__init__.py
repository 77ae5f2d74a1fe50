"""redline's inference engine: LLM(model).generate(prompts, SamplingParams(...)), .chat(conversations, ...),
.beam_search(prompts, BeamSearchParams(...)).

The heavy parts (torch, the models) load on first use of LLM/LLMEngine, so `engine.sampling.params`
is importable by producers that have no torch.
"""
from engine.lora.request import LoRARequest
from engine.sampling.params import BeamSearchParams, SamplingParams

_LAZY = {"LLM": "engine.core.llm_engine", "LLMEngine": "engine.core.llm_engine",
         **dict.fromkeys(("RequestOutput", "CompletionOutput", "StepResult", "StepStats"), "engine.core.outputs")}

__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "LoRARequest", "RequestOutput", "CompletionOutput",
           "StepResult", "StepStats"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
