"""Shared fixtures: tiny random checkpoints written by transformers, the way users' checkpoints are."""
from __future__ import annotations

import gc
import shutil
import sys
from pathlib import Path

import pytest
import torch

from engine.builtin import TINY_MODEL_DIR

FAMILIES = ("qwen3", "qwen2", "llama")
# families with sliding-window layers (windows shorter than the tests' prompts), soft-capping, Gemma's norms
WINDOWED_FAMILIES = ("mistral", "gemma2", "gemma3", "phi3")


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
    elif family == "mistral":
        config = tf.MistralConfig(**{**common, "sliding_window": 10, "head_dim": 16, **overrides})
        cls = tf.MistralForCausalLM
    elif family == "gemma2":  # one local layer (window 12), one global; caps small enough to bite
        gemma = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=12, attn_logit_softcapping=3.0,
                     final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh")
        config = tf.Gemma2Config(**{**common, **gemma, **overrides})
        cls = tf.Gemma2ForCausalLM
    elif family == "gemma3":  # two local layers on their own rope (window 9), one global with linear scaling
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
        gemma = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=9, num_hidden_layers=3,
                     layer_types=["sliding_attention", "sliding_attention", "full_attention"], rope_parameters=rope,
                     hidden_activation="gelu_pytorch_tanh")
        config = tf.Gemma3TextConfig(**{**common, **gemma, **overrides})
        cls = tf.Gemma3ForCausalLM
    elif family == "phi3":  # LongRoPE whose long factors start past 256 positions (the long test lowers it)
        half = common["hidden_size"] // common["num_attention_heads"] // 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [2.0 + 0.5 * i for i in range(half)]}
        config = tf.Phi3Config(**{**common, "sliding_window": 11, "original_max_position_embeddings": 256,
                                  "rope_parameters": rope, "pad_token_id": 0, **overrides})
        cls = tf.Phi3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(config).eval()
    if family in ("gemma2", "gemma3"):
        # Gemma's norms start at zero (a scale of one): make their weights matter; larger q/k norms sharpen
        # Gemma 3's attention, so that its windows matter. (Untied embeddings: tied ones, scaled by
        # sqrt(hidden_size), would make a tiny random model repeat its last token.)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.normal_(1.0, 0.3)
                elif name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
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


@pytest.fixture
def free_gpu():
    """The test's GPU memory handed back after it (the GPU tests build engines and reference models)."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy completions from transformers itself, one prompt at a time (no padding effects), with its eager
    attention (the one that soft-caps logits and masks sliding windows in every family)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=model.config.eos_token_id,
                                 pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def preempt_every(llm, steps: int, sliding_only: bool = False) -> None:
    """Make the scheduler preempt its newest running sequence every `steps` schedules (a sliding window's
    sequences hand back the blocks their windows passed, so a small KV cache alone rarely runs short);
    sliding_only: only where the model's layers slide."""
    if sliding_only and not llm.block_manager.sliding_window:
        return
    schedule, count = llm.scheduler.schedule, []

    def schedule_preempting():
        count.append(1)
        if len(count) % steps == 0 and llm.scheduler.running:
            llm.scheduler.preempt(llm.scheduler.running[-1])
        return schedule()

    llm.scheduler.schedule = schedule_preempting


def watch_chunks(llm) -> list[int]:
    """The list the scheduler's steps will add each partial prompt chunk's token count to (chunked prefill)."""
    chunks, schedule = [], llm.scheduler.schedule

    def schedule_watched():
        batch = schedule()
        chunks.extend(n for s, n in zip(batch.seqs, batch.num_tokens) if s.num_computed_tokens + n < s.num_tokens)
        return batch

    llm.scheduler.schedule = schedule_watched
    return chunks


def kernels_compiled_for_hopper(call, names: tuple[str, ...] = ()) -> list[str]:
    """Compile each Triton kernel `call()` launches (none of them run; only those `names` names, if given) for
    sm_90 as the wrappers launch it (bench/kernel_ir.py), each within the H100's 227 KB of shared memory; their
    names. Skips the test where this Triton has no CUDA backend."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
    import kernel_ir

    compiled = []
    for kernel, args, kwargs in kernel_ir.launches(call):
        if names and kernel.fn.__name__ not in names:
            continue
        try:
            binary = kernel_ir.compile_for(kernel, args, kwargs, 90)
        except ImportError as e:  # a Triton without the CUDA backend
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        assert binary.metadata.shared <= 227 * 1024, kernel.fn.__name__
        compiled.append(kernel.fn.__name__)
    return compiled


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; without it they are skipped, saying so."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run bench/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
