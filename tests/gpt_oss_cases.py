"""gpt-oss end to end on the GPU's kernels, run by the Triton interpreter on CPU: the attention through the triton
backend (qkv_prep, the prefill and split-KV decode kernels, fused decode, each with the sinks and the sliding
window) and the MoE layers through the fused kernels (router bias, expert biases, the clamped SwiGLU), against
transformers' greedy tokens. Run as a script (TRITON_INTERPRET=1), it prints one JSON object; shared by
tests/test_gpt_oss.py."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


def engine_on_kernels(async_scheduling: bool) -> dict:
    from engine import LLM, SamplingParams
    from engine.attention.triton_backend import TritonBackend
    from engine.kernels import fused_moe
    from engine.layers import moe
    from tests.conftest import hf_greedy
    from tests.test_gpt_oss import make_gpt_oss_checkpoint
    from tests.test_windowed_families import prompts_of

    moe_calls = []

    def fused_kernels(x, weight, name):
        moe_calls.append(name)
        return fused_moe

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_gpt_oss_checkpoint(Path(tmp) / "gpt-oss")
        prompts = prompts_of(4, seed=8, longest=30) + prompts_of(2, shared_prefix=16, seed=9, longest=10)
        expected = hf_greedy(model_dir, prompts, 8)
        moe._kernels_for = fused_kernels
        llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8, async_scheduling=async_scheduling)
        backend = TritonBackend()
        llm.runner.ctx.backend = backend
        attention_calls = []
        for name in ("forward", "decode_from_qkv", "qkv_prep"):
            call = getattr(backend, name)
            setattr(backend, name, lambda *a, _call=call, _name=name, **k: (attention_calls.append(_name),
                                                                             _call(*a, **k))[1])
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return {"equal": [o.token_ids for o in outs] == expected, "moe_calls": len(moe_calls),
            "fused_decode_calls": attention_calls.count("decode_from_qkv"),
            "prefill_calls": attention_calls.count("forward")}


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    torch.set_num_threads(1)
    print(json.dumps({"sync": engine_on_kernels(False)}))


if __name__ == "__main__":
    main()
