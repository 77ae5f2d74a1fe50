"""Tiny random Qwen2.5-VL checkpoints written by transformers, with the image processor and a tokenizer beside
them, and transformers' own greedy generation on them (the reference the engine must equal)."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import torch

from engine.builtin import TINY_MODEL_DIR

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_vl_checkpoint(out_dir: Path, seed: int = 0, text: dict | None = None, vision: dict | None = None,
                       dtype=torch.float32, max_pixels: int = 224 * 224) -> Path:
    """save_pretrained a tiny random Qwen2.5-VL (two decoder layers, a two-block vision tower whose first
    block attends within 2 x 2 windows of merged patches, the second over the whole image), the image
    processor (from 56x56 pixels to max_pixels) and the built-in tiny tokenizer with the vision tokens added."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    text_cfg = dict(vocab_size=520, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                    eos_token_id=tok.eos_token_id, pad_token_id=0, bos_token_id=None, initializer_range=0.2)
    text_cfg.update(text or {})
    vision_cfg = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=text_cfg["hidden_size"], window_size=56, fullatt_block_indexes=[1], initializer_range=0.2)
    vision_cfg.update(vision or {})
    config = tf.Qwen2_5_VLConfig(text_config=text_cfg, vision_config=vision_cfg, vision_start_token_id=ids[0],
                                 vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3],
                                 tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.Qwen2_5_VLForConditionalGeneration(config).eval().to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor = image_processor_class()(min_pixels=56 * 56, max_pixels=max_pixels)
    processor.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def image_processor_class():
    """transformers' Qwen2-VL image processor: its torchvision backend where installed, else its PIL one."""
    import transformers as tf
    try:
        import torchvision  # noqa: F401
        return tf.Qwen2VLImageProcessor
    except ImportError:
        return tf.Qwen2VLImageProcessorPil


def noise_image(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def hf_inputs(model_dir: Path, text: str, images: list):
    """What transformers' Qwen2.5-VL processor makes of (text, images): each placeholder's <|image_pad|>
    repeated once per merged patch in the text, then tokenized, and the image processor's pixels."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if not images:
        return {"input_ids": torch.tensor([tok.encode(text)])}
    ip = AutoImageProcessor.from_pretrained(model_dir)
    pix = ip(images=images, return_tensors="pt")
    parts = text.split("<|image_pad|>")
    assert len(parts) == len(images) + 1
    merge = ip.merge_size ** 2
    expanded = parts[0]
    for grid, rest in zip(pix["image_grid_thw"], parts[1:]):
        expanded += "<|image_pad|>" * int(grid.prod() // merge) + rest
    ids = torch.tensor([tok.encode(expanded)])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    return {"input_ids": ids, "pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"],
            "mm_token_type_ids": (ids == image_id).int()}


def hf_vl_greedy(model_dir: Path, cases: list[tuple[str, list]], max_new_tokens: int, dtype=torch.float32):
    """transformers' greedy tokens (and the prompt ids it saw) for each (text, images), one at a time."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype,
                                                               attn_implementation="eager").eval()
    outs = []
    with torch.no_grad():
        for text, images in cases:
            inputs = hf_inputs(model_dir, text, images)
            ids = inputs["input_ids"]
            gen = model.generate(**inputs, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=model.config.text_config.eos_token_id,
                                 pad_token_id=0)
            outs.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
    return outs
