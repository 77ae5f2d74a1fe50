"""Images in prompts on a tiny random Qwen2.5-VL written by transformers (its image processor and tokenizer
beside it): greedy tokens equal transformers' generate on the same processor outputs, with 0, 1 and 2 images
of different sizes, through prefix-cache hits (same image) and misses (another image), preemption, chunked
prefill across image tokens and chat's image_url parts; unusable images fail their request alone."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.inputs.images import ImageError
from tests.multimodal_helpers import PLACEHOLDER as P
from tests.multimodal_helpers import data_url, hf_vl_greedy, make_vl_checkpoint, noise_image, png_bytes

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
PREFIX = "The queue holds jobs until a worker has room for them. "  # 13 tokens of text before an image


def _cases():
    a, b, c = noise_image(56, 56, 1), noise_image(84, 112, 2), noise_image(140, 196, 3)
    return [
        ("Tell me a story about a brave knight", []),
        (P + "What is the capital of France?", [a]),
        ("Numbers " + P + " and " + P + " the sea", [b, c]),
        (PREFIX + P + "Summarise this text in one sentence.", [b]),
        (PREFIX + P + "Summarise this text in one sentence.", [noise_image(84, 112, 4)]),  # same tokens, other image
        ("Write a haiku " + P + P, [c, a]),
    ]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    model_dir = make_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"))
    cases = _cases()
    return model_dir, cases, hf_vl_greedy(model_dir, cases, MAX_NEW)


def _requests(cases):
    return [{"prompt": text, "images": images} for text, images in cases]


def _llm(model_dir, **kwargs):
    return LLM(str(model_dir), device="cpu", **{"kvcache_block_size": 8, **kwargs})


def test_greedy_tokens_match_transformers_with_0_1_and_2_images(vl):
    model_dir, cases, expected = vl
    llm = _llm(model_dir)
    outs = llm.generate(_requests(cases), GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids for ids, _ in expected]  # placeholders expanded alike
    assert [o.token_ids for o in outs] == [toks for _, toks in expected]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_a_checkpoint_with_the_decoder_under_model_language_model_loads_alike(vl, tmp_path):
    """The layout transformers 4.52-4.57 saved (model.language_model.*, model.visual.*) gives the same tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir, cases, expected = vl
    nested = tmp_path / "nested"
    shutil.copytree(model_dir, nested)
    for f in nested.glob("*.safetensors"):
        tensors = load_file(f)
        renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
                    "model." + k if k.startswith("visual.") else k): v for k, v in tensors.items()}
        assert any(k.startswith("model.language_model.layers.") for k in renamed)
        save_file(renamed, f, metadata={"format": "pt"})
    outs = _llm(nested).generate(_requests(cases), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [toks for _, toks in expected]


def test_other_images_give_other_tokens(vl):
    """The images reach the decoder: the same text with other images generates otherwise."""
    model_dir, cases, expected = vl
    llm = _llm(model_dir)
    swapped = [(text, [noise_image(56, 56, 40 + i) for i in range(len(images))]) for text, images in cases[1:3]]
    outs = llm.generate(_requests(swapped), GREEDY, use_tqdm=False)
    assert all(o.token_ids != toks for o, (_, toks) in zip(outs, expected[1:3]))


def test_prefix_cache_hits_the_same_image_and_misses_another(vl):
    model_dir, cases, expected = vl
    llm = _llm(model_dir)
    bm, bs = llm.block_manager, 8
    first = llm.generate(_requests([cases[3]]), GREEDY, use_tqdm=False)[0]
    hits = bm.num_cache_hits
    again = llm.generate(_requests([cases[3]]), GREEDY, use_tqdm=False)[0]
    same_image_hits = bm.num_cache_hits - hits
    other = llm.generate(_requests([cases[4]]), GREEDY, use_tqdm=False)[0]
    other_image_hits = bm.num_cache_hits - hits - same_image_hits
    assert first.token_ids == again.token_ids == expected[3][1]
    assert other.token_ids == expected[4][1]
    assert other.prompt_token_ids == first.prompt_token_ids  # the same tokens: only the image differs
    assert same_image_hits == (len(first.prompt_token_ids) - 1) // bs * bs  # every full block, image blocks too
    image_start = first.prompt_token_ids.index(llm.images.image_token_id)
    assert other_image_hits == image_start // bs * bs  # only the text blocks before the image
    assert 0 < other_image_hits < same_image_hits


def test_preemption_and_recompute_keep_images_and_tokens(vl):
    model_dir, cases, expected = vl
    llm = _llm(model_dir, kvcache_block_size=4, num_kvcache_blocks=40, max_model_len=128,
               enable_prefix_caching=False)
    outs = llm.generate(_requests(cases), GREEDY, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [toks for _, toks in expected]


def test_chunked_prefill_across_image_tokens_keeps_tokens(vl):
    model_dir, cases, expected = vl
    llm = _llm(model_dir, max_num_batched_tokens=7)
    split_images, image_steps, text_steps = [], [], []
    schedule, build = llm.scheduler.schedule, llm.steps.build

    def spy_schedule():
        batch = schedule()
        for seq, n in zip(batch.seqs, batch.num_tokens):
            mm, end = seq.multimodal, seq.num_computed_tokens + n
            if mm is not None and any(s < end < s + length for s, length in mm.vision_placeholders):
                split_images.append(seq.seq_id)
        return batch

    def spy_build(batch, sampled, *rest):
        inputs = build(batch, sampled, *rest)
        (image_steps if inputs.mrope_positions is not None else text_steps).append(inputs.images)
        return inputs

    llm.scheduler.schedule, llm.steps.build = spy_schedule, spy_build
    outs = llm.generate(_requests(cases), GREEDY, use_tqdm=False)
    assert split_images, "no chunk ended inside an image's tokens"
    assert [o.token_ids for o in outs] == [toks for _, toks in expected]
    assert image_steps and all(image_steps) and text_steps


def test_cache_preemption_chunking_and_async_scheduling_together(vl):
    model_dir, cases, expected = vl
    llm = _llm(model_dir, kvcache_block_size=4, num_kvcache_blocks=40, max_model_len=128, max_num_batched_tokens=9,
               async_scheduling=True)
    outs = llm.generate(_requests(cases + cases[1:4]), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [toks for _, toks in expected + expected[1:4]]
    assert llm.scheduler.num_preemptions > 0 and llm.block_manager.num_cache_hits > 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_the_runner_keeps_an_images_embeddings_until_its_last_token_or_its_request_ends(vl):
    """The vision tower's output lives in the runner, by (request, image), never on the sequence: an image
    split across prefill chunks is encoded once and dropped with its last token; an image whose request is
    aborted part-way is dropped with the next step."""
    model_dir, cases, expected = vl
    llm = _llm(model_dir, max_num_batched_tokens=7, enable_prefix_caching=False)  # cases[3]: image at 14-25
    encoded = []
    encode = llm.runner._encode_images
    llm.runner._encode_images = lambda images: encoded.extend(s.key for s in images) or encode(images)
    outs = llm.generate(_requests(cases[3:4]), GREEDY, use_tqdm=False)
    assert outs[0].token_ids == expected[3][1]
    assert encoded == [(outs[0].request_id, 0)] and llm.runner.image_embeds == {}
    aborted = llm.add_request(_requests(cases[3:4])[0], GREEDY)
    kept = llm.add_request(_requests(cases[1:2])[0], GREEDY)
    for _ in range(3):  # three chunks of 7 tokens reach the image, and its last token is still ahead
        llm.step()
    assert (aborted, 0) in llm.runner.image_embeds
    llm.abort(aborted)
    outs = {}
    while llm.has_unfinished():
        outs.update((o.request_id, o) for o in llm.step().finished)
    assert outs[kept].token_ids == expected[1][1] and outs[aborted].finish_reason == "abort"
    assert llm.runner.image_embeds == {}


def test_text_only_steps_on_a_vl_model_run_the_text_path(vl):
    """Steps without image tokens carry no M-RoPE streams nor embeddings (the text decoder's inputs);
    decode positions continue at index + mrope_position_delta."""
    model_dir, cases, expected = vl
    llm = _llm(model_dir)
    steps = []
    build = llm.steps.build

    def spy(batch, sampled, *rest):
        inputs = build(batch, sampled, *rest)
        steps.append((inputs.is_decode, inputs.mrope_positions, inputs.images,
                      [(s.num_tokens - 1 + s.mrope_position_delta) for s in batch.seqs], inputs.positions.tolist()))
        return inputs

    llm.steps.build = spy
    outs = llm.generate(_requests(cases[:2]), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [toks for _, toks in expected[:2]]
    decodes = [s for s in steps if s[0]]
    assert decodes and all(m is None and not e and want == got for _, m, e, want, got in decodes)
    assert sum(m is not None for _, m, _, _, _ in steps) == 1  # the one prefill step with the image's tokens


def test_images_as_bytes_paths_and_data_urls_give_the_same_tokens(vl, tmp_path):
    model_dir, cases, expected = vl
    text, images = cases[2]
    path = tmp_path / "second.png"
    path.write_bytes(png_bytes(images[1]))
    llm = _llm(model_dir)
    outs = llm.generate([{"prompt": text, "images": [png_bytes(images[0]), str(path)]},
                         {"prompt": text, "images": [data_url(images[0]), path]}], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [expected[2][1]] * 2


def test_chat_with_image_url_parts_equals_the_templated_prompt(vl):
    model_dir, cases, _ = vl
    llm = _llm(model_dir)
    a, b = cases[2][1]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Numbers "},
                                             {"type": "image_url", "image_url": {"url": data_url(a)}},
                                             {"type": "text", "text": " and "},
                                             {"type": "image_url", "image_url": {"url": data_url(b)}}]}]
    chat = llm.chat([messages], GREEDY, use_tqdm=False)[0]
    templated = ("<|im_start|>user\nNumbers " + P + " and " + P + "<|im_end|>\n<|im_start|>assistant\n")
    plain = llm.generate([{"prompt": templated, "images": [a, b]}], GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.token_ids == plain.token_ids
    text_only = llm.chat([[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]], GREEDY, use_tqdm=False)[0]
    assert text_only.prompt_token_ids == llm.chat([[{"role": "user", "content": "Hi"}]], GREEDY,
                                                  use_tqdm=False)[0].prompt_token_ids


@pytest.mark.parametrize("images, limits, message", [
    ([b"this is not an image"], {}, "not an image in a known format"),
    (["big"], {"max_image_bytes": 2000}, "the limit is 2,000 bytes per image"),
    (["small", "small", "small"], {"max_images_per_prompt": 2}, "3 images in one prompt; the limit is 2"),
    (["https://example.com/cat.png"], {}, "the worker fetches nothing"),
    (["data:image/png;base64,@@@@"], {}, "not valid base64"),
    ([3.5], {}, "an image must be a PIL.Image, bytes, a file path or a data URL"),
])
def test_bad_images_fail_their_request_with_one_clear_line(vl, images, limits, message):
    model_dir, cases, expected = vl
    llm = _llm(model_dir, **limits)
    made = {"big": png_bytes(noise_image(84, 84, 5)), "small": noise_image(56, 56, 6)}
    images = [made.get(im, im) if isinstance(im, str) else im for im in images]
    with pytest.raises(ImageError) as err:
        llm.add_request({"prompt": P * len(images) + "Describe.", "images": images}, GREEDY)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not llm.has_unfinished()  # nothing was queued; the engine serves on
    out = llm.generate(_requests(cases[1:2]), GREEDY, use_tqdm=False)[0]
    assert out.token_ids == expected[1][1]


def test_placeholder_count_must_match_the_images(vl):
    model_dir, _, _ = vl
    llm = _llm(model_dir)
    with pytest.raises(ValueError, match="2 image placeholders .* for 1 images"):
        llm.add_request({"prompt": P + P, "images": [noise_image(56, 56, 1)]}, GREEDY)
    with pytest.raises(ValueError, match="image placeholder tokens .* but no images"):
        llm.add_request(P + "hello", GREEDY)
    # no placeholder at all: one per image at the start
    out = llm.generate([{"prompt": "What is the capital of France?", "images": [noise_image(56, 56, 1)]}], GREEDY,
                       use_tqdm=False)[0]
    assert out.token_ids == llm.generate(_requests(_cases()[1:2]), GREEDY, use_tqdm=False)[0].token_ids


def test_a_text_model_refuses_images(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), device="cpu")
    with pytest.raises(ValueError, match="takes no images"):
        llm.add_request({"prompt": "hi", "images": [noise_image(56, 56, 1)]})
    assert llm.generate([{"prompt": "hi", "images": []}], GREEDY, use_tqdm=False)[0].finish_reason in ("stop", "length")


def test_max_model_len_counts_image_tokens(vl):
    model_dir, _, _ = vl
    llm = _llm(model_dir, max_model_len=40)
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens; max_model_len is 40"):
        llm.add_request({"prompt": "Describe " + P, "images": [noise_image(140, 196, 3)]}, GREEDY)  # 35 image tokens
