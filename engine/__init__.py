"""redline's inference engine: LLM(model).generate(prompts, SamplingParams(...))."""
from engine.llm_engine import LLM, LLMEngine
from engine.outputs import RequestOutput, StepResult, StepStats
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "StepResult", "StepStats"]
