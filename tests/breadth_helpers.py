"""Shared parts of the generation-breadth tests: a checkpoint whose EOS is a token the model reaches, and
transformers' own beam search and step-by-step logits on it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def checkpoint_with_eos(checkpoint: Path, eos: int, out_dir: Path) -> Path:
    """A copy of `checkpoint` (same weights) whose config names `eos` the EOS token."""
    shutil.copytree(checkpoint, out_dir, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        path = out_dir / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos
            path.write_text(json.dumps(cfg))
    return out_dir


def load_hf(checkpoint: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def hf_beams(model, prompt: list[int], width: int, max_new: int, length_penalty: float, eos: int):
    """transformers' beams for one prompt: [(completion ids up to its EOS, cumulative logprob)], best first."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                             length_penalty=length_penalty, early_stopping=True, do_sample=False,
                             max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    beams = []
    for row, score in zip(out.sequences, out.sequences_scores):
        tokens = row[len(prompt):].tolist()
        if eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        beams.append((tokens, float(score) * len(tokens) ** length_penalty))  # sequences_scores are penalised
    return beams


def hf_adjusted_greedy(model, prompt: list[int], max_new: int, adjust) -> tuple[list[int], float]:
    """Greedy tokens and their summed logprob from transformers' logits, each step's logits passed through
    adjust(logits [V] float32, generated ids) first (no cache: the whole sequence each step)."""
    ids, total = list(prompt), 0.0
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float().cpu()
            logits = adjust(logits.clone(), ids[len(prompt):])
            token = int(logits.argmax())
            total += float(logits.log_softmax(-1)[token])
            ids.append(token)
    return ids[len(prompt):], total
