"""Images in prompts, before any model sees them: what an image input may be, its limits, data URLs and
OpenAI-style chat content parts. Imports no torch (the producer validates jobs with it); PIL is imported
only where an image is opened.

An image is a PIL.Image, the bytes of an encoded image (PNG, JPEG, ...), a local file path, or a data URL
(`data:image/png;base64,...`). Nothing is fetched from the network: an http(s) URL is refused.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import re

MAX_IMAGES_PER_PROMPT = 8          # default limit on the images of one prompt (job)
MAX_IMAGE_BYTES = 8 * 1024 * 1024  # default limit on one encoded image
MAX_IMAGE_PIXELS = 40_000_000      # an image larger than this (width x height) is refused before it is decoded
# default limit on the pixels of all the images of one prompt (job) together, from their headers before any is
# decoded: ~150 MB as RGB, so that a job's decoding takes a bounded time and memory
MAX_PIXELS_PER_PROMPT = 50_000_000

_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+)?(;[A-Za-z0-9=.+-]+)*;base64,", re.ASCII)


class ImageError(ValueError):
    """A prompt's image is unusable (not an image, too large, too many): the request's own error."""


def decoded_size(b64: str) -> int:
    """Bytes that a base64 string decodes to (without decoding it)."""
    n = len(b64.rstrip("="))
    return n * 3 // 4


def data_url_payload(url: str, max_bytes: int = MAX_IMAGE_BYTES) -> str:
    """The base64 payload of a `data:image/...;base64,` URL, checked for its form and size (not decoded)."""
    if not isinstance(url, str):
        raise ImageError(f"an image URL must be a string, got {type(url).__name__}")
    m = _DATA_URL.match(url)
    if m is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        if url.startswith(("http://", "https://")):
            raise ImageError(f"image URL {shown!r} is a web address; the worker fetches nothing: send the image "
                             "inline as a data URL (data:image/png;base64,...)")
        raise ImageError(f"image URL {shown!r} is not a base64 data URL (data:image/png;base64,...)")
    payload = url[m.end():]
    size = decoded_size(payload)
    if size > max_bytes:
        raise ImageError(f"an image has {size:,} bytes; the limit is {max_bytes:,} bytes per image")
    return payload


def image_parts(content) -> list[str]:
    """The image URLs of one message's content (a string has none); raises ImageError for a malformed part.
    A part is {"type": "text", "text": ...} or {"type": "image_url", "image_url": {"url": ...}} (the URL
    may also be given directly as a string)."""
    if isinstance(content, str):
        return []
    if not isinstance(content, list):
        raise ImageError(f"message content must be a string or a list of content parts, got {type(content).__name__}")
    urls = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ImageError(f"content part {i}: a text part needs a string 'text'")
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ImageError(f"content part {i}: an image_url part needs 'image_url': {{'url': 'data:image/...'}}")
            urls.append(url)
        else:
            raise ImageError(f"content part {i}: type must be 'text' or 'image_url', got {kind!r}")
    return urls


def has_images(messages) -> bool:
    """Whether chat messages hold an image part (a quick look; image_parts checks the form)."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
               for m in messages)


def check_message_images(messages: list[dict], max_images: int = MAX_IMAGES_PER_PROMPT,
                         max_bytes: int = MAX_IMAGE_BYTES) -> int:
    """Check the image parts of chat messages (form, count, each one's size) without decoding them; returns
    how many there are."""
    urls = [u for m in messages for u in image_parts(m.get("content") if isinstance(m, dict) else None)]
    if len(urls) > max_images:
        raise ImageError(f"{len(urls)} images in one prompt; the limit is {max_images}")
    for url in urls:
        data_url_payload(url, max_bytes)
    return len(urls)


def load_images(images: list, max_bytes: int = MAX_IMAGE_BYTES,
                max_pixels_per_prompt: int = MAX_PIXELS_PER_PROMPT) -> list:
    """One prompt's images as PIL images in RGB, their pixels counted from their headers before any is
    decoded; ImageError with the reason where one is unusable or they are too many pixels together."""
    opened = [open_image(im, max_bytes) for im in images]
    total = sum(img.size[0] * img.size[1] for img in opened)
    if total > max_pixels_per_prompt:
        raise ImageError(f"the prompt's {len(opened)} images have {total:,} pixels in all; the limit is "
                         f"{max_pixels_per_prompt:,} pixels per prompt: send fewer or smaller images")
    return [decode_image(img) for img in opened]


def open_image(image, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS):
    """A PIL image opened from a PIL.Image, encoded bytes, a file path or a data URL, its size checked but
    its pixels not yet decoded (PIL reads the header only)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        img = image
    else:
        if isinstance(image, str) and image.startswith("data:"):
            try:
                data = base64.b64decode(data_url_payload(image, max_bytes), validate=True)
            except (binascii.Error, ValueError) as e:
                if isinstance(e, ImageError):
                    raise
                raise ImageError(f"an image's data URL is not valid base64 ({e})") from None
        elif isinstance(image, str) and image.startswith(("http://", "https://")):
            data_url_payload(image, max_bytes)  # raises: nothing is fetched
        elif isinstance(image, (str, os.PathLike)):
            try:
                size = os.path.getsize(image)
            except OSError as e:
                raise ImageError(f"image file {str(image)[:200]!r} cannot be read ({e.strerror})") from None
            if size > max_bytes:
                raise ImageError(f"image file has {size:,} bytes; the limit is {max_bytes:,} bytes per image")
            with open(image, "rb") as f:
                data = f.read()
        elif isinstance(image, (bytes, bytearray, memoryview)):
            data = bytes(image)
        else:
            raise ImageError(f"an image must be a PIL.Image, bytes, a file path or a data URL, got "
                             f"{type(image).__name__}")
        if len(data) > max_bytes:
            raise ImageError(f"an image has {len(data):,} bytes; the limit is {max_bytes:,} bytes per image")
        try:
            img = Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise ImageError("an image could not be read: not an image in a known format "
                             f"({type(e).__name__})") from None
    width, height = img.size
    if width < 1 or height < 1:
        raise ImageError(f"an image is {width}x{height} pixels; it must have at least one pixel")
    if width * height > max_pixels:
        raise ImageError(f"an image is {width}x{height} pixels; the limit is {max_pixels:,} pixels")
    return img


def decode_image(img):
    """An opened image's pixels, decoded, in RGB."""
    from PIL import Image

    try:
        return img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"an image could not be decoded ({type(e).__name__}: {str(e)[:200]})") from None
