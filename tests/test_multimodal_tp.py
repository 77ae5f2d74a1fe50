"""Qwen2.5-VL across tensor-parallel ranks: every rank runs the vision tower on the step's images (its weights
whole on each) and its share of the decoder's heads. On CPU (gloo), TP=2 against transformers' greedy tokens with
0, 1 and 2 images, through prefix-cache hits, preemption and chunked prefill across image tokens; on two GPUs,
TP=2 against TP=1."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine import LLM
from tests.test_multimodal import GREEDY, MAX_NEW, _cases, _requests
from tests.multimodal_helpers import hf_vl_greedy, make_vl_checkpoint
from tests.test_tp import assert_ranks_gone


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    model_dir = make_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl_tp"))
    cases = _cases()
    return model_dir, cases, hf_vl_greedy(model_dir, cases, MAX_NEW)


@pytest.mark.timeout(300)
def test_tp2_images_give_transformers_tokens_with_prefix_cache_preemption_and_chunks(vl):
    model_dir, cases, expected = vl
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=2, kvcache_block_size=4, num_kvcache_blocks=60,
              max_model_len=160, max_num_batched_tokens=24)
    pids = llm.runner.worker_pids
    chunked_images, schedule = [], llm.scheduler.schedule

    def spy():
        batch = schedule()
        chunked_images.extend(s.multimodal is not None and s.num_computed_tokens + n < s.num_tokens
                              for s, n in zip(batch.seqs, batch.num_tokens))
        return batch

    llm.scheduler.schedule = spy
    try:
        outs = llm.generate(_requests(cases) + _requests(cases[3:4]), GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == [toks for _, toks in expected] + [expected[3][1]]
        assert any(chunked_images)  # a prompt with images prefilled in chunks
        assert llm.scheduler.num_preemptions > 0
        assert llm.block_manager.num_cache_hits > 0
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    finally:
        llm.shutdown()
    assert_ranks_gone(pids)


_GPU_TOKENS = """
import json, sys
from engine import LLM, SamplingParams
from tests.test_multimodal import _cases, _requests
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cuda", dtype="float32", tensor_parallel_size=int(sys.argv[2]), max_model_len=1024)
    outs = llm.generate(_requests(_cases()), SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    print(json.dumps([o.token_ids for o in outs]))
    llm.shutdown()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_images_give_tp1_tokens_on_two_gpus(vl):
    """fp32, so that the two splits of the decoder's sums agree to the token."""
    model_dir, _, _ = vl
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    runs = {}
    for tp in (1, 2):  # GPU engines in processes of their own (docs/tensor-parallel.md)
        proc = subprocess.run([sys.executable, "-c", _GPU_TOKENS, str(model_dir), str(tp)], capture_output=True,
                              text=True, env=env, timeout=500, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[tp] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs[2] == runs[1]
