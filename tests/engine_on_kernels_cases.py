"""The engine end to end on the GPU's kernels, run by the Triton interpreter on CPU, against transformers' greedy
tokens: gpt-oss with its attention through the triton backend (qkv_prep, the prefill and split-KV decode kernels,
fused decode, each with the sinks and the sliding window) and its MoE layers through the fused kernels (router
bias, expert biases, the clamped SwiGLU); Mistral with blocks of 4 positions handed back behind a window of 10,
under the kernels' tiles of 16 (which read the handed-back pages' places and must not weigh them). Run as a
script (TRITON_INTERPRET=1; argv: the cases to run, default all), it prints one JSON object; shared by tests/test_gpt_oss.py and
tests/test_windowed_families.py."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


def count_calls(backend, names: tuple[str, ...]) -> list[str]:
    """The names of `backend`'s methods among `names`, one entry a call, as they are called."""
    calls = []
    for name in names:
        call = getattr(backend, name)
        setattr(backend, name, lambda *a, _call=call, _name=name, **k: (calls.append(_name), _call(*a, **k))[1])
    return calls


def gpt_oss_on_kernels() -> dict:
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
        llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8)
        llm.runner.ctx.backend = backend = TritonBackend()
        attention_calls = count_calls(backend, ("forward", "decode_from_qkv"))
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return {"equal": [o.token_ids for o in outs] == expected, "moe_calls": len(moe_calls),
            "fused_decode_calls": attention_calls.count("decode_from_qkv"),
            "prefill_calls": attention_calls.count("forward")}


def mistral_handed_back_on_kernels() -> dict:
    from engine import LLM, SamplingParams
    from engine.attention.triton_backend import TritonBackend
    from tests.conftest import hf_greedy, make_checkpoint
    from tests.test_windowed_families import prompts_of

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint("mistral", Path(tmp) / "mistral")  # window 10
        prompts = prompts_of(3, seed=12, longest=40)
        expected = hf_greedy(model_dir, prompts, 40)
        llm = LLM(str(model_dir), device="cpu", kvcache_block_size=4, max_num_batched_tokens=24)
        llm.runner.ctx.backend = backend = TritonBackend()
        attention_calls = count_calls(backend, ("forward", "decode_from_qkv"))
        released, schedule = [], llm.scheduler.schedule

        def spy():
            batch = schedule()
            released.extend(s.num_released_blocks for s in batch.seqs)
            return batch

        llm.scheduler.schedule = spy
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    return {"equal": [o.token_ids for o in outs] == expected, "most_released": max(released),
            "fused_decode_calls": attention_calls.count("decode_from_qkv"),
            "prefill_calls": attention_calls.count("forward")}


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    torch.set_num_threads(1)
    cases = {"gpt_oss": gpt_oss_on_kernels, "mistral_handed_back": mistral_handed_back_on_kernels}
    print(json.dumps({name: cases[name]() for name in sys.argv[1:] or cases}))


if __name__ == "__main__":
    main()
