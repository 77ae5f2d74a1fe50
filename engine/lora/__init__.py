"""LoRA adapters per request: PEFT adapters applied to the rows of the sequences that name them (docs/lora.md)."""
from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
