"""Embeddings: how an embedding request pools the final hidden states of its prompt, and its vector.

An embedding request is a sequence that is prefilled and never sampled: each step that computes part of its
prompt hands the runner the rows to pool (a sum of rows, engine/runner.py's StepInputs.pooled_rows), the
engine adds the sums up as the chunks come back and finishes the request at its prompt's end. The pooling
and normalisation are the model's own, read from its sentence-transformers files: modules.json names the
modules (a `Normalize` module means L2 normalisation), the Pooling module's config.json the pooling
(last token, mean or CLS); without modules.json, last token and L2.

Mean and CLS pooling need the hidden state of every prompt position (CLS: of the first), and a prefix-cache
hit skips computing the positions it serves: such requests never reuse cached blocks (they are computed from
the first position; their blocks still enter the cache for others). Last-token pooling reuses them, since the
last position is always computed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

POOLING_METHODS = ("lasttoken", "mean", "cls")
# sentence-transformers' older Pooling config: one boolean per mode
_LEGACY_MODE_KEYS = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
                     "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                     "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens": "weightedmean"}
# modules after the transformer that change nothing an embedding of the final hidden states needs
_NEUTRAL_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class Pooling:
    """A model's pooling: which hidden states make the embedding, and whether it is L2-normalised."""
    method: str = "lasttoken"
    normalize: bool = True

    @property
    def reuses_cached_prefix(self) -> bool:
        """Whether a request may take prompt blocks from the prefix cache (their positions are not computed)."""
        return self.method == "lasttoken"


def read_pooling(model_dir: str) -> Pooling:
    """The pooling of the model in `model_dir`, from its sentence-transformers files; last token and L2
    without them. A pooling this engine does not compute is refused in one line."""
    root = Path(model_dir)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return Pooling()
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [(str(m.get("type", "")).rsplit(".", 1)[-1], str(m.get("path", ""))) for m in modules]
    except (ValueError, AttributeError, TypeError):
        raise ValueError(f"{modules_file} is not a sentence-transformers modules list") from None
    other = [kind for kind, _ in kinds if kind not in _NEUTRAL_MODULES]
    if other:
        raise ValueError(f"the model's modules.json has a {other[0]} module; embeddings support Transformer, "
                         "Pooling and Normalize modules only")
    pooling_paths = [path for kind, path in kinds if kind == "Pooling"]
    if not pooling_paths:
        raise ValueError(f"the model's modules.json has no Pooling module ({modules_file})")
    config_file = root / pooling_paths[0] / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        raise ValueError(f"the model's pooling config {config_file} is missing or not JSON") from None
    return Pooling(_pooling_method(config), normalize=any(kind == "Normalize" for kind, _ in kinds))


def _pooling_method(config: dict) -> str:
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [name for key, name in _LEGACY_MODE_KEYS.items() if config.get(key)]
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in POOLING_METHODS:
        raise ValueError(f"the model pools by {'+'.join(map(str, modes)) or 'nothing'}; embeddings support one of "
                         f"{', '.join(POOLING_METHODS)}")
    if config.get("include_prompt", True) is False:
        raise ValueError("the model's pooling leaves out the prompt (include_prompt false); not supported")
    return modes[0]


def check_dimensions(dimensions, hidden_size: int) -> int | None:
    """`dimensions` as given, checked against the model's embedding size."""
    if dimensions is None:
        return None
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= hidden_size:
        raise ValueError(f"dimensions must be an integer in [1, {hidden_size}] (the model's embedding size), "
                         f"got {dimensions!r}")
    return dimensions


def pooled_positions(method: str, start: int, end: int, num_tokens: int) -> range:
    """The positions of a prompt chunk [start, end) of a prompt of num_tokens tokens whose hidden states a
    request pooled by `method` sums."""
    if method == "mean":
        return range(start, end)
    if method == "cls":
        return range(1) if start == 0 else range(0)
    return range(num_tokens - 1, num_tokens) if end == num_tokens else range(0)


class PooledState:
    """One embedding request's pooling: its method, its sum of hidden states so far and its dimensions."""

    def __init__(self, pooling: Pooling, dimensions: int | None):
        self.pooling = pooling
        self.dimensions = dimensions
        self.total: torch.Tensor | None = None  # float32 on the host

    @property
    def reuses_cached_prefix(self) -> bool:
        return self.pooling.reuses_cached_prefix

    def add(self, chunk_sum: torch.Tensor, start: int) -> None:
        """A chunk's sum; a chunk at position 0 starts over (the sequence was recomputed from its start)."""
        self.total = chunk_sum.clone() if start == 0 or self.total is None else self.total + chunk_sum

    def embedding(self, num_tokens: int) -> list[float]:
        """The request's vector: pooled, normalised as the model is, then truncated to `dimensions` and
        L2-normalised again (matryoshka)."""
        vector = self.total / num_tokens if self.pooling.method == "mean" else self.total
        if self.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        if self.dimensions is not None:
            vector = torch.nn.functional.normalize(vector[: self.dimensions], dim=0)
        return vector.tolist()
