"""A prompt's images on the host: preprocessing, placeholder tokens, M-RoPE positions, content hashes.

Seed 003's lifecycle: a request that has images gets its multimodal data (`MultimodalInputs`: the
preprocessed `pixel_values`, each image's `image_grid_thw` and `vision_placeholders`) before its sequence
waits. All of it is made here, on the caller's thread (add_request, or the worker's reader thread), never
inside a step. A step whose prefill chunk reaches an image's placeholder tokens carries its pixels
(engine/core/step_builder.py); the model runner runs the vision tower on them and splices the embeddings in
their place, keeping them until the image's last token (engine/execution/model_runner.py).

Positions (Qwen2-VL's M-RoPE): three streams (temporal, height, width). Text tokens advance all three
together; an image's tokens, a grid of h x w merged patches, take (start, start + row, start + column)
with start the position after the text before it, and the text after the image resumes at
start + max(h, w). A sequence therefore keeps `mrope_position_delta` (the last prompt position + 1 minus
the prompt's length): every token after the prompt is at position index + delta in all three streams,
which is plain rotary at that position, so decode steps run the text model's kernels unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from engine.inputs.images import (
    MAX_IMAGE_BYTES,
    MAX_IMAGES_PER_PROMPT,
    MAX_PIXELS_PER_PROMPT,
    ImageError,
    image_parts,
    load_images,
)

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass
class MultimodalInputs:
    """A sequence's images, from the image processor, and what the engine derives from them."""

    pixel_values: torch.Tensor                  # [patches, channels * temporal_patch * patch^2], float32, host
    image_grid_thw: list[tuple[int, int, int]]   # each image's patch grid (t, h, w) before merging
    vision_placeholders: list[tuple[int, int]]   # each image's (first prompt index, number of tokens)
    image_hashes: list[int]                      # each image's content hash (its pixel values and grid)
    mrope_positions: np.ndarray                  # [3, prompt tokens] positions of the three streams
    mrope_position_delta: int
    patch_offsets: list[int]                     # each image's first row in pixel_values, then the total

    @property
    def end(self) -> int:
        """The prompt index after the last image token."""
        start, length = self.vision_placeholders[-1]
        return start + length

    def images_in(self, start: int, end: int) -> list[int]:
        """The images with a placeholder token in prompt indices [start, end)."""
        return [i for i, (s, n) in enumerate(self.vision_placeholders) if s < end and start < s + n]

    def image_key(self, start: int, end: int) -> tuple[int, ...] | None:
        """What a KV block over [start, end) depends on beyond its tokens: the hashes of its images."""
        found = self.images_in(start, end)
        return tuple(self.image_hashes[i] for i in found) if found else None

    def positions(self, start: int, end: int) -> np.ndarray:
        """[3, end - start] M-RoPE positions of indices [start, end) (past the prompt: index + delta)."""
        num_prompt = self.mrope_positions.shape[1]
        head = self.mrope_positions[:, start:min(end, num_prompt)]
        if end <= num_prompt:
            return head
        tail = np.arange(max(start, num_prompt), end, dtype=np.int64) + self.mrope_position_delta
        return np.concatenate([head, np.broadcast_to(tail, (3, len(tail)))], axis=1)


@dataclass
class MultimodalPrompt:
    """A prompt ready for the engine: token ids with each image's placeholders expanded, and its images."""

    token_ids: list[int]
    multimodal: MultimodalInputs


def mrope_positions(num_tokens: int, placeholders: list[tuple[int, int]], grids: list[tuple[int, int, int]],
                    merge: int) -> tuple[np.ndarray, int]:
    """The three position streams of a prompt and its delta (the module's docstring)."""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    cur = i = 0
    for (start, length), (t, h, w) in zip(placeholders, grids):
        pos[:, i:start] = np.arange(cur, cur + start - i)
        cur += start - i
        gh, gw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos[0, start:start + length] = tt.ravel() + cur
        pos[1, start:start + length] = hh.ravel() + cur
        pos[2, start:start + length] = ww.ravel() + cur
        cur += max(gh, gw)
        i = start + length
    pos[:, i:] = np.arange(cur, cur + num_tokens - i)
    return pos, int(pos.max()) + 1 - num_tokens


class ImagePrompts:
    """Turns (token ids, images) into a MultimodalPrompt for one vision-language model, with its image
    processor (transformers', from the model's directory) and limits."""

    def __init__(self, model_dir: str, hf_config, max_images: int = MAX_IMAGES_PER_PROMPT,
                 max_image_bytes: int = MAX_IMAGE_BYTES, max_pixels_per_prompt: int = MAX_PIXELS_PER_PROMPT):
        self.model_dir = model_dir
        self._processor = None  # loaded with the first image: text-only use needs no preprocessor_config.json
        self.image_token_id = hf_config.image_token_id
        self.vision_start_token_id = hf_config.vision_start_token_id
        self.vision_end_token_id = hf_config.vision_end_token_id
        self.merge = hf_config.vision_config.spatial_merge_size
        self.max_images, self.max_image_bytes = max_images, max_image_bytes
        self.max_pixels_per_prompt = max_pixels_per_prompt

    @property
    def processor(self):
        if self._processor is None:
            from transformers import AutoImageProcessor

            try:
                self._processor = AutoImageProcessor.from_pretrained(self.model_dir)
            except Exception as e:  # noqa: BLE001 - a checkpoint without preprocessor_config.json
                raise ValueError(f"the model in {self.model_dir} has no usable image processor "
                                 f"(preprocessor_config.json): {type(e).__name__}: {str(e)[:200]}") from None
        return self._processor

    def check_text(self, token_ids: list[int]) -> None:
        """A prompt without images may not hold image placeholder tokens (they would have nothing to show)."""
        if self.image_token_id in token_ids:
            raise ValueError("the prompt holds image placeholder tokens (<|image_pad|>) but no images were given")

    def prepare(self, token_ids: list[int], images: list) -> MultimodalPrompt:
        """Expand each image's placeholder (one <|image_pad|> per image, where the image goes) into its
        tokens; a prompt with no placeholder gets one per image at its start."""
        if not isinstance(images, (list, tuple)):
            raise ImageError(f"images must be a list, got {type(images).__name__}")
        if len(images) > self.max_images:
            raise ImageError(f"{len(images)} images in one prompt; the limit is {self.max_images}")
        token_ids = list(token_ids)
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if not slots:
            one = [self.vision_start_token_id, self.image_token_id, self.vision_end_token_id]
            token_ids = one * len(images) + token_ids
            slots = [3 * k + 1 for k in range(len(images))]
        if len(slots) != len(images):
            raise ImageError(f"the prompt has {len(slots)} image placeholders (<|image_pad|>) for {len(images)} "
                             f"images; put one {IMAGE_PLACEHOLDER} where each image goes")
        pil = load_images(images, self.max_image_bytes, self.max_pixels_per_prompt)
        try:
            out = self.processor(images=pil, return_tensors="pt")
        except Exception as e:  # noqa: BLE001 - an image the processor cannot take is the request's
            raise ImageError(f"an image could not be preprocessed: {type(e).__name__}: {str(e)[:200]}") from None
        pixel_values = out["pixel_values"].to(torch.float32).contiguous()
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]
        offsets = [0]
        for t, h, w in grids:
            offsets.append(offsets[-1] + t * h * w)
        expanded, placeholders, last = [], [], 0
        for slot, (t, h, w) in zip(slots, grids):
            expanded += token_ids[last:slot]
            length = t * h * w // self.merge ** 2
            placeholders.append((len(expanded), length))
            expanded += [self.image_token_id] * length
            last = slot + 1
        expanded += token_ids[last:]
        hashes = [_image_hash(pixel_values[offsets[i]:offsets[i + 1]], grids[i]) for i in range(len(grids))]
        positions, delta = mrope_positions(len(expanded), placeholders, grids, self.merge)
        mm = MultimodalInputs(pixel_values, grids, placeholders, hashes, positions, delta, offsets)
        return MultimodalPrompt(expanded, mm)

def chat_parts(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """Chat messages for a chat template (image_url parts as {"type": "image"}, which Qwen-VL templates render
    as one placeholder; a list of text parts only as one string) and their images' URLs in order."""
    out, urls = [], []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        found = image_parts(content)
        if found:
            content = [{"type": "image"} if p["type"] == "image_url" else {"type": "text", "text": p["text"]}
                       for p in content]
        else:
            content = "".join(p["text"] for p in content)
        urls += found
        out.append({**m, "content": content})
    return out, urls


def _image_hash(pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> int:
    h = xxhash.xxh64()
    h.update(np.asarray(grid, dtype=np.int64).tobytes())
    h.update(pixel_values.numpy().tobytes())
    return h.intdigest()
