"""LoRA adapters per request: greedy tokens under each adapter equal transformers' with the adapter merged
(peft's merge_and_unload), in mixed batches with the base model and other adapters."""
from __future__ import annotations

import json
import random

import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.conftest import hf_greedy, make_checkpoint
from tests.lora_helpers import ADAPTERS, make_adapter, merge_adapter

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def _prompts(n: int, seed: int, prefix: list[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(3, 500) for _ in range(rng.randint(2, 30))] for _ in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen3 base, its adapters, and for each adapter (and the base) transformers' greedy tokens."""
    root = tmp_path_factory.mktemp("lora")
    base = make_checkpoint("qwen3", root / "base")
    prompts = _prompts(3, seed=7)
    requests, expected = [], {None: hf_greedy(base, prompts, MAX_NEW)}
    for i, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        path = make_adapter(base, root / name, rank, alpha, targets, rslora, seed=i)
        merged = merge_adapter(base, path, root / f"{name}-merged")
        request = LoRARequest(name, i + 1, str(path))
        requests.append(request)
        expected[request.int_id] = hf_greedy(merged, prompts, MAX_NEW)
    return base, prompts, requests, expected


def _mixed(prompts, requests):
    """Every prompt under every adapter and the base, interleaved: (prompts, their LoRA requests)."""
    pairs = [(p, r) for p in prompts for r in [None, *requests]]
    return [p for p, _ in pairs], [r for _, r in pairs]


def _expected(prompts, requests, expected, mixed_loras):
    index = {tuple(p): i for i, p in enumerate(prompts)}
    return [expected[None if r is None else r.int_id][index[tuple(p)]] for p, r in mixed_loras]


def test_adapters_change_the_tokens(setup):
    _, _, requests, expected = setup
    assert all(expected[r.int_id] != expected[None] for r in requests)


def test_mixed_batch_matches_transformers_with_each_adapter_merged(setup):
    base, prompts, requests, expected = setup
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=4, max_lora_rank=16, kvcache_block_size=8)
    all_prompts, loras = _mixed(prompts, requests)
    outs = llm.generate(all_prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.token_ids for o in outs] == _expected(prompts, requests, expected, zip(all_prompts, loras))


def test_chat_takes_lora_requests_as_generate_does(setup):
    base, _, requests, _ = setup
    llm = LLM(str(base), device="cpu", enable_lora=True, max_lora_rank=16)
    conversation = [{"role": "user", "content": "Name a color."}]
    chats = llm.chat([conversation] * 2, GREEDY, use_tqdm=False, lora_request=[requests[1], None])
    prompt = llm.encode_chat(conversation)
    generated = llm.generate([prompt] * 2, GREEDY, use_tqdm=False, lora_request=[requests[1], None])
    assert [o.token_ids for o in chats] == [o.token_ids for o in generated]
    assert chats[0].token_ids != chats[1].token_ids


def test_more_adapters_than_slots_in_one_call(setup):
    base, prompts, requests, expected = setup
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, kvcache_block_size=8)
    slots, loads = llm.scheduler.lora_slots, []
    take = slots.take_loads

    def spy():
        taken = take()
        loads.extend(taken)
        return taken

    slots.take_loads = spy
    all_prompts, loras = _mixed(prompts, requests)
    outs = llm.generate(all_prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.token_ids for o in outs] == _expected(prompts, requests, expected, zip(all_prompts, loras))
    assert len(loads) > 2 and {slot for slot, *_ in loads} == {0, 1}  # adapters were swapped through two slots


def test_prefix_cache_blocks_are_not_shared_across_adapters(setup):
    base, _, requests, expected = setup
    prompts = _prompts(2, seed=11, prefix=list(range(10, 42)))
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, kvcache_block_size=8,
              max_num_seqs=1)
    first = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests[0])
    hits = llm.block_manager.num_cache_hits
    assert hits > 0  # the second prompt reused the first one's prefix under the same adapter
    base_outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    # the base model's second prompt hits its first prompt's blocks, none of the adapter's
    assert llm.block_manager.num_cache_hits == 2 * hits
    other = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests[1])
    reference = LLM(str(base), device="cpu", enable_lora=True, max_lora_rank=16, enable_prefix_caching=False)
    assert [o.token_ids for o in first] == [o.token_ids for o in reference.generate(
        prompts, GREEDY, use_tqdm=False, lora_request=requests[0])]
    assert [o.token_ids for o in base_outs] == [o.token_ids for o in reference.generate(prompts, GREEDY,
                                                                                        use_tqdm=False)]
    assert [o.token_ids for o in other] == [o.token_ids for o in reference.generate(
        prompts, GREEDY, use_tqdm=False, lora_request=requests[1])]


def _write_adapter_config(path, **changes):
    cfg_file = path / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(changes)
    cfg_file.write_text(json.dumps(cfg))


def test_bad_lora_requests_are_refused_in_one_line(setup, tmp_path):
    import shutil

    base, prompts, requests, _ = setup
    plain = LLM(str(base), device="cpu")
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests[0])
    llm = LLM(str(base), device="cpu", enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16; max_lora_rank is 8"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests[2])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 9, str(tmp_path / "missing")))
    odd = shutil.copytree(requests[0].path, tmp_path / "odd")
    _write_adapter_config(odd, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="targets lm_head; supported target modules"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("odd", 10, str(odd)))
    _write_adapter_config(odd, target_modules=["q_proj"], bias="all")
    with pytest.raises(ValueError, match="only bias='none'"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("odd", 11, str(odd)))
    with pytest.raises(ValueError, match="needs an id of its own"):
        llm.generate(prompts, GREEDY, use_tqdm=False,
                     lora_request=[requests[0], LoRARequest("clash", requests[0].int_id, requests[1].path), None])
    with pytest.raises(ValueError, match="positive integer"):
        LoRARequest("zero", 0, requests[0].path)
    one_layer = LLM(str(make_checkpoint("qwen3", tmp_path / "one-layer", num_hidden_layers=1)), device="cpu",
                    enable_lora=True, max_lora_rank=16)
    with pytest.raises(ValueError, match=r"adapts model\.layers\.1\..*, which this model does not have"):
        one_layer.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests[0])
    # nothing of the refused calls stayed in the engine: the next call runs as usual
    assert len(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests[0])) == len(prompts)
    assert not llm.has_unfinished()


def test_tensor_parallel_adapters_match_transformers(setup):
    """TP=2 (gloo): A of the row-parallel projections split along their input, B of the column-parallel ones
    along their output; with more adapters than slots."""
    base, prompts, requests, expected = setup
    llm = LLM(str(base), device="cpu", tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=16,
              kvcache_block_size=8)
    try:
        all_prompts, loras = _mixed(prompts, requests)
        outs = llm.generate(all_prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert [o.token_ids for o in outs] == _expected(prompts, requests, expected, zip(all_prompts, loras))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fmt", ["fp8-block-16", "awq"])
def test_adapter_on_a_quantized_base_matches_transformers_on_its_dequantized_weights(tmp_path, fmt):
    """A quantized checkpoint's projections hold no float weight; an adapter adds to their products all the same:
    tokens equal transformers' on the dequantized weights with the adapter merged."""
    from tests.quant_helpers import quantize_checkpoint

    base = make_checkpoint("qwen3", tmp_path / "base")
    reference = quantize_checkpoint(base, tmp_path / fmt, fmt)
    name, rank, alpha, targets, rslora = ADAPTERS[1]  # every projection
    adapter = make_adapter(reference, tmp_path / name, rank, alpha, targets, rslora, seed=3)
    prompts = _prompts(3, seed=11)
    want = hf_greedy(merge_adapter(reference, adapter, tmp_path / "merged"), prompts, MAX_NEW)
    llm = LLM(str(tmp_path / fmt), device="cpu", enable_lora=True, max_lora_rank=16, kvcache_block_size=8)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest(name, 1, str(adapter)))
    assert [o.token_ids for o in outs] == want
    base_tokens = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert base_tokens == hf_greedy(reference, prompts, MAX_NEW)


def test_an_adapters_prefix_hashes_are_those_its_blocks_are_cached_by(setup):
    """What cache-aware admission reads ahead with: a prompt's block hashes under an adapter are the ones the
    prefix cache enters for it, and not the base model's; with prefer_cached_prefixes a mixed batch keeps its
    tokens."""
    base, prompts, requests, expected = setup
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=4, max_lora_rank=16, kvcache_block_size=8,
              prefer_cached_prefixes=True)
    prompt = list(range(5, 5 + 3 * 8 + 3))
    llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=requests[0])
    under, plain = llm.prefix_block_hashes(prompt, requests[0]), llm.prefix_block_hashes(prompt)
    assert len(under) == 3 and llm.num_cached_blocks(under) == 3 and llm.num_cached_blocks(plain) == 0
    all_prompts, loras = _mixed(prompts, requests)
    outs = llm.generate(all_prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.token_ids for o in outs] == _expected(prompts, requests, expected, zip(all_prompts, loras))
