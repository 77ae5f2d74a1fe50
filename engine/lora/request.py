"""What a request names to run under a LoRA adapter (imports no torch)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors, as save_pretrained writes
    it). int_id identifies the adapter in the engine (its GPU slot and its prefix-cache blocks): one id, one
    path."""
    name: str
    int_id: int
    path: str

    def __post_init__(self) -> None:
        if isinstance(self.int_id, bool) or not isinstance(self.int_id, int) or self.int_id < 1:
            raise ValueError(f"LoRARequest int_id must be a positive integer, got {self.int_id!r}")
