"""The model's tokenizer, when its directory has one."""
from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: str):
    """AutoTokenizer for `model_dir`, or None when it ships no tokenizer files (token-id prompts only)."""
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)
