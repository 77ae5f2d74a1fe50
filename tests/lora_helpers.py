"""PEFT adapters on tiny checkpoints, written by peft's save_pretrained, and their merged references."""
from __future__ import annotations

from pathlib import Path

import torch

# (name, rank, alpha, target modules, rslora): different ranks, targets and scales
ADAPTERS = (
    ("sql", 8, 16, ["q_proj", "v_proj"], False),
    ("chat", 4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    ("mlp", 16, 4, ["gate_proj", "down_proj"], True),
    ("attn", 2, 32, ["k_proj", "o_proj", "up_proj"], False),
)


def make_adapter(base_dir: Path, out_dir: Path, rank: int, alpha: int, targets: list[str], rslora: bool,
                 seed: int) -> Path:
    """A LoRA adapter of the checkpoint at base_dir with random A and B (peft starts B at zero, which would
    change nothing), saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                            lora_dropout=0.0, bias="none"))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    return out_dir


def merge_adapter(base_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """The base with the adapter merged into its weights (peft's merge_and_unload), saved as a checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
