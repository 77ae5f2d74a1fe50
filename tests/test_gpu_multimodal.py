"""Qwen2.5-VL in bf16 on the GPU against transformers bf16 on the same random checkpoint, shaped as the shipped
Qwen2.5-VL-3B config (engine/configs/qwen2.5-vl-3b: decoder and vision widths, heads, M-RoPE sections,
112-pixel windows) with four decoder layers and four vision blocks (the second and fourth attending over the
whole image). Run on a GPU machine (bench/gpu_check.sh)."""
from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.builtin import SHIPPED_CONFIGS
from tests.multimodal_helpers import PLACEHOLDER as P
from tests.multimodal_helpers import hf_inputs, make_vl_checkpoint, noise_image

pytestmark = pytest.mark.gpu
MAX_NEW = 16


def _shape() -> tuple[dict, dict]:
    with open(f"{SHIPPED_CONFIGS['qwen2.5-vl-3b']}/config.json") as f:
        c = json.load(f)
    text = {k: c[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                              "vocab_size", "rms_norm_eps", "max_position_embeddings")}
    text.update(num_hidden_layers=4, initializer_range=0.02,
                rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"],
                                 "mrope_section": c["rope_scaling"]["mrope_section"]})
    v = c["vision_config"]
    vision = {k: v[k] for k in ("hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
                                "spatial_merge_size", "window_size", "temporal_patch_size")}
    vision.update(depth=4, fullatt_block_indexes=[1, 3], initializer_range=0.02)
    return text, vision


CASES = [
    ("Describe " + P + " in one sentence.", [(448, 448)]),
    ("Compare " + P + " with " + P + ".", [(336, 224), (224, 336)]),
    ("Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000.", []),
]


def _cases():
    return [(text, [noise_image(w, h, 10 * i + j) for j, (w, h) in enumerate(sizes)])
            for i, (text, sizes) in enumerate(CASES)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    text, vision = _shape()
    return make_vl_checkpoint(tmp_path_factory.mktemp("gpu-qwen2_5_vl"), text=text, vision=vision,
                              dtype=torch.bfloat16, max_pixels=448 * 448)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.bfloat16,
                                                              attn_implementation="eager").cuda().eval()


def _hf(inputs: dict) -> dict:
    return {k: v.cuda() for k, v in inputs.items()}


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "eager-ops"])
def test_prompt_logits_with_images_match_transformers_bf16(checkpoint, hf_model, fused, free_gpu):
    """Every prompt position's logits, the images' tokens included (vision tower, spliced embeddings,
    M-RoPE's three streams), from one prefill step of the engine against transformers' forward."""
    llm = LLM(str(checkpoint), device="cuda", dtype="bfloat16", kvcache_block_size=16, num_kvcache_blocks=256,
              enforce_eager=True, fused_layers=fused)
    runner, errors = llm.runner, []
    for text, images in _cases():
        llm.add_request({"prompt": text, "images": images}, SamplingParams(max_tokens=1))
        batch = llm.scheduler.schedule()
        inputs = llm.steps.build(batch, batch.sampled())
        n = len(inputs.input_ids)
        inputs.logits_indices = torch.arange(n)
        with torch.inference_mode():
            ours = runner.compute_logits(runner.forward(inputs), inputs).float()
            ref = hf_model(**_hf(hf_inputs(checkpoint, text, images))).logits[0].float()
        assert ref.shape[0] == n
        errors.append((len(images), n, float((ours - ref).norm() / ref.norm())))
        for seq in batch.seqs:
            llm.scheduler.finish(seq, "abort")
    print("images, prompt length, relative error against transformers bf16:", errors)
    assert max(e for _, _, e in errors) < 2e-2, errors


def test_greedy_tokens_with_images_equal_transformers_bf16_up_to_near_ties(checkpoint, hf_model, free_gpu):
    """Through the decode CUDA graphs (positions + mrope_position_delta), the prefix cache and chunked prefill
    across image tokens; where a sequence parts from transformers, the two tokens are a near-tie for it."""
    cases = _cases()
    llm = LLM(str(checkpoint), device="cuda", dtype="bfloat16", max_model_len=1024, max_num_batched_tokens=128)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    requests = [{"prompt": t, "images": im} for t, im in cases]
    llm.generate(requests[:1], greedy, use_tqdm=False)
    outs = llm.generate(requests, greedy, use_tqdm=False)
    assert llm.runner.graphs is not None and llm.block_manager.num_cache_hits > 0
    del llm
    same, gaps = 0, []
    with torch.inference_mode():
        for (text, images), out in zip(cases, outs):
            inputs = _hf(hf_inputs(checkpoint, text, images))
            ids = inputs["input_ids"]
            ref = hf_model.generate(**inputs, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=MAX_NEW, eos_token_id=2, pad_token_id=0)[0, ids.shape[1]:].tolist()
            if ref == out.token_ids:
                same += 1
                continue
            at = next(i for i, (a, b) in enumerate(zip(ref, out.token_ids)) if a != b)
            longer = dict(inputs, input_ids=torch.cat([ids, torch.tensor([ref[:at]], device="cuda")], 1))
            if "mm_token_type_ids" in longer:
                longer["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"],
                                                         torch.zeros(1, at, dtype=torch.int32, device="cuda")], 1)
            logits = hf_model(**longer).logits[0, -1].float()
            gaps.append(float((logits[ref[at]] - logits[out.token_ids[at]]) / logits.std()))
    print(f"{same}/{len(cases)} equal; divergence gaps in logit std: {sorted(gaps)}")
    assert same >= 1 and all(g < 0.1 for g in gaps), sorted(gaps)
