"""A tiny built-in model (Qwen3 shape, byte-level BPE tokenizer) for demos and tests.

It has no weights on disk: load it with load_format="dummy" (random weights).
"""
from pathlib import Path

TINY_MODEL_DIR = str(Path(__file__).resolve().parent / "tiny-qwen3")
