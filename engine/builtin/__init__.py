"""Models named by a word instead of a path: a tiny built-in model and the shipped benchmark shapes.

None of them has weights on disk. "tiny" (Qwen3 shape, byte-level BPE tokenizer, for demos and tests)
implies load_format="dummy"; the benchmark shapes (config.json only) need it said.
"""
from pathlib import Path

TINY_MODEL_NAME = "tiny"
TINY_MODEL_DIR = str(Path(__file__).resolve().parent / "tiny-qwen3")
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
SHIPPED_CONFIGS = {p.name: str(p) for p in sorted(CONFIGS_DIR.iterdir()) if (p / "config.json").is_file()}
BUILTIN_MODELS = {TINY_MODEL_NAME: TINY_MODEL_DIR, **SHIPPED_CONFIGS}
