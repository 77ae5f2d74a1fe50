"""`redline bench --caption-images`: single-image captioning on a vision-language model (the Qwen2.5-VL-3B
shape by default, dummy weights).

Workload: random.seed(seed); --num-seqs requests (256), each one random-noise RGB image of --image-size
pixels and a 16-token instruction of ids in [0, 10000], max_tokens=randint(32, 128), ignore_eos. The
images are preprocessed on the host before the clock starts (their seconds are reported apart); the timed
generate() runs the vision tower inside the prefill steps. The vision tower's share is the seconds spent in
it, each call timed between two device synchronisations, over the wall seconds of the run.
"""
from __future__ import annotations

import json
import random
import time
from datetime import datetime, timezone
from pathlib import Path

DEFAULT_MODEL = "qwen2.5-vl-3b"


def noise_images(count: int, width: int, height: int, seed: int) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB") for _ in range(count)]


def make_workload(args, llm):
    """(prepared prompts, one SamplingParams each, host preprocessing seconds)."""
    from engine.sampling.params import SamplingParams

    random.seed(args.seed)
    width, height = (int(x) for x in args.image_size.lower().split("x"))
    top = min(10000, llm.vocab_size - 1)
    instructions = [[random.randint(0, top) for _ in range(16)] for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=random.randint(32, 128))
              for _ in range(args.num_seqs)]
    images = noise_images(args.num_seqs, width, height, args.seed)
    start = time.perf_counter()
    prompts = [llm.prepare_prompt({"prompt": ids, "images": [im]}) for ids, im in zip(instructions, images)]
    return prompts, params, time.perf_counter() - start


class VisionClock:
    """Wraps the model's encode_images: seconds in the vision tower, between device synchronisations."""

    def __init__(self, model):
        import torch

        self.seconds, self.images, inner = 0.0, 0, model.encode_images
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

        def timed(pixels, grids):
            sync()
            start = time.perf_counter()
            out = inner(pixels, grids)
            sync()
            self.seconds += time.perf_counter() - start
            self.images += len(grids)
            return out

        model.encode_images = timed


def run(args) -> dict:
    from worker.bench_engine import build_llm, git_commit, gpu_name, resolve_model

    if args.model == "qwen3-0.6b":  # bench's text default: captioning takes the VL shape instead
        args.model = DEFAULT_MODEL
    llm = build_llm(args)
    if getattr(llm, "images", None) is None:
        raise ValueError(f"--caption-images needs a vision-language model; {args.model} takes no images")
    prompts, params, preprocess_s = make_workload(args, llm)
    warm = noise_images(min(16, args.num_seqs), *(int(x) for x in args.image_size.lower().split("x")),
                        seed=args.seed + 1)  # other images: the prefix cache stays cold for the timed run
    llm.generate([{"prompt": [7] * 16, "images": [im]} for im in warm], params[:len(warm)], use_tqdm=False)
    clock = VisionClock(llm.runner.model)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    record = {
        "gpu": gpu_name(), "commit": git_commit(getattr(args, "commit", None)),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "model": Path(resolve_model(args.model)).name,
        "workload": "caption-images", "num_seqs": args.num_seqs, "image_size": args.image_size,
        "image_tokens": sum(len(p.token_ids) for p in prompts) - 16 * len(prompts), "tokens": tokens,
        "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1), "req_s": round(len(prompts) / seconds, 2),
        "vision_seconds": round(clock.seconds, 3), "vision_share": round(clock.seconds / seconds, 3),
        "vision_images": clock.images, "preprocess_seconds": round(preprocess_s, 3),
    }
    print(f"{record['model']} on {record['gpu']}: {len(prompts)} captions ({args.image_size} images), {tokens} tokens "
          f"in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s; vision tower {clock.seconds:.2f} s "
          f"({100 * clock.seconds / seconds:.1f}%); host preprocessing {preprocess_s:.2f} s (not timed)")
    print(json.dumps(record), flush=True)
    llm.shutdown()
    return record
