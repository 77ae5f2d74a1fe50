"""Worker settings: flags, then environment variables (REDLINE_<NAME>), then defaults.

Every field is also a `redline worker` flag (`max_num_seqs` → `--max-num-seqs`), generated from the
model below, so a setting is declared once. Times are in seconds.
"""
from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import Literal, get_args

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine import images
from producer import protocol

# Fields passed to LLMEngine as keyword arguments when set; unset ones keep the engine's defaults.
ENGINE_FIELDS = ("load_format", "dtype", "device", "tensor_parallel_size", "max_num_seqs",
                 "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization", "kvcache_block_size",
                 "num_kvcache_blocks", "enable_prefix_caching", "enforce_eager", "attention_backend",
                 "kv_cache_dtype", "async_scheduling", "fused_layers", "tp_all_reduce", "seed",
                 "max_images_per_prompt", "max_image_bytes", "max_pixels_per_prompt",
                 "max_seqs_per_request")


def default_redis_data_dir() -> str:
    """Where an embedded redis-server keeps its data: this user's XDG data folder."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return os.path.join(base, "redline", "redis")


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REDLINE_", extra="ignore", protected_namespaces=())

    model: str | None = Field(None, description="HF hub id or local model directory (required)")
    redis_url: str | None = Field(None, validation_alias=AliasChoices("redis_url", "REDLINE_REDIS_URL", "REDIS_URL"),
                                  description="Redis to serve: redis://HOST:PORT/DB, or redis+cluster://HOST:PORT"
                                              "[,HOST:PORT...] for a Redis Cluster; unset: start an embedded "
                                              "redis-server")
    redis_data_dir: str = Field(default_factory=default_redis_data_dir,
                                description="without --redis-url: the embedded redis-server's data (append-only "
                                            "file) lives here, one worker at a time "
                                            "[$XDG_DATA_HOME/redline/redis, else ~/.local/share/redline/redis]")
    redis_password: str | None = Field(None, description="Redis password when the URL has none (e.g. from a "
                                                         "secret: REDLINE_REDIS_PASSWORD)")
    queue: str = Field("default", description="queue name")
    worker_name: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
                             description="consumer name in the group, unique per live worker")
    metrics_port: int | None = Field(None, description="serve Prometheus /metrics on this port")
    claim_timeout: float = Field(30.0, gt=0, description="an in-flight job idle this long belongs to a dead worker")
    max_deliveries: int = Field(3, ge=1, description="deliveries before a job goes to the dead-letter stream")
    result_ttl: int = Field(protocol.RESULT_TTL_S, ge=1, description="keep results this long")
    max_job_bytes: int = Field(protocol.MAX_JOB_BYTES, ge=1024, description="larger jobs fail")
    stream_interval: float = Field(0.02, ge=0, description="write token deltas at most this often")
    drain_timeout: float = Field(60.0, ge=0,
                                 description="on SIGTERM, let running jobs finish this long, then hand them back")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    celery_queue: str | None = Field(None, min_length=1,
                                     description="also serve this Celery queue (tasks 'redline.generate' sent by "
                                                 "Celery producers to the same Redis; results in Celery's backend)")
    celery_visibility_timeout: float = Field(60.0, gt=0, description="a Celery task whose worker has not been heard "
                                                                     "from this long goes back to its queue")

    load_format: str | None = Field(None, description="auto | safetensors | dummy (random weights)")
    dtype: str | None = Field(None, description="auto | bfloat16 | float16 | float32")
    device: str | None = Field(None, description="auto | cuda | cpu")
    tensor_parallel_size: int | None = Field(None, description="GPUs the model is split across")
    max_num_seqs: int | None = Field(None, description="sequences in one batch")
    max_seqs_per_request: int | None = Field(None, description="most of max_num_seqs one job (n, best_of) may "
                                                               "hold [max_num_seqs // 2]")
    max_num_batched_tokens: int | None = Field(None, description="tokens in one engine step")
    max_model_len: int | None = Field(None, description="prompt plus completion tokens")
    gpu_memory_utilization: float | None = Field(None, description="share of GPU memory to use")
    kvcache_block_size: int | None = Field(None, description="tokens per KV block")
    num_kvcache_blocks: int | None = Field(None, description="fix the KV cache size")
    enable_prefix_caching: bool | None = Field(None, description="reuse KV blocks of shared prefixes")
    enforce_eager: bool | None = Field(None, description="no CUDA graphs")
    attention_backend: str | None = Field(None, description="auto | triton | flash | torch")
    kv_cache_dtype: str | None = Field(None, description="auto (the model's dtype) | fp8 (one byte an element, lossy)")
    async_scheduling: bool | None = Field(None, description="prepare the next step while the GPU runs this one "
                                                            "(default: on for GPUs)")
    fused_layers: bool | None = Field(None, description="False: the layers as plain PyTorch ops (debugging)")
    tp_all_reduce: str | None = Field(None, description="engine (the engine's all-reduce kernels on GPUs) | nccl")
    seed: int | None = Field(None, description="seed of dummy weights and of unseeded sampling")
    max_images_per_prompt: int | None = Field(None, description="vision-language models: most images in one job "
                                                                f"[{images.MAX_IMAGES_PER_PROMPT}]")
    max_image_bytes: int | None = Field(None, description="vision-language models: most bytes of one encoded "
                                                          f"image [{images.MAX_IMAGE_BYTES}]")
    max_pixels_per_prompt: int | None = Field(None, description="vision-language models: most pixels (width x "
                                                                f"height) of one job's images together "
                                                                f"[{images.MAX_PIXELS_PER_PROMPT}]")

    @property
    def engine_kwargs(self) -> dict:
        return {k: getattr(self, k) for k in ENGINE_FIELDS if getattr(self, k) is not None}


def add_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per setting. Defaults are None so that environment variables and defaults apply."""
    for name, field in WorkerSettings.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = field.description or ""
        if field.default is not None and not field.default_factory:
            help_text += f" [{field.default}]"
        kinds = [t for t in (bool, int, float) if t in (field.annotation, *get_args(field.annotation))]
        if kinds and kinds[0] is bool:
            parser.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, type=kinds[0] if kinds else str, help=help_text)


def from_args(args: argparse.Namespace) -> WorkerSettings:
    """Settings from parsed flags; a flag left unset falls back to REDLINE_<NAME>, then the default."""
    given = {k: v for k, v in vars(args).items() if k in WorkerSettings.model_fields and v is not None}
    return WorkerSettings(**given)
