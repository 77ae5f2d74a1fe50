"""Shared fixtures: tiny random checkpoints written by transformers, the way users' checkpoints are."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine.builtin import TINY_MODEL_DIR

FAMILIES = ("qwen3", "qwen2", "llama")


def make_checkpoint(family: str, out_dir: Path, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """save_pretrained a tiny random model of `family` (config.json + model.safetensors) into out_dir."""
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, eos_token_id=2, pad_token_id=0, bos_token_id=None,
                  initializer_range=0.2, tie_word_embeddings=False)
    if family == "qwen3":
        config = tf.Qwen3Config(**{**common, "head_dim": 16, "tie_word_embeddings": True, **overrides})
        cls = tf.Qwen3ForCausalLM
    elif family == "qwen2":
        config = tf.Qwen2Config(**{**common, **overrides})
        cls = tf.Qwen2ForCausalLM
    elif family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
        config = tf.LlamaConfig(rope_parameters=rope, **{**common, **overrides})
        cls = tf.LlamaForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer:
        for f in Path(TINY_MODEL_DIR).iterdir():
            if f.name != "config.json":
                shutil.copy(f, out_dir / f.name)
    return out_dir


@pytest.fixture(scope="session", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> Path:
    return make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3-single"))


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy completions from transformers itself, one prompt at a time (no padding effects)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=model.config.eos_token_id,
                                 pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; without it they are skipped, saying so."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run bench/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
