"""Worker settings: flags, then environment variables (REDLINE_<NAME>), then defaults.

Every field is also a `redline worker` flag (`max_num_seqs` → `--max-num-seqs`), generated from the
model below, so a setting is declared once. Times are in seconds.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
from dataclasses import fields
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

from pydantic import AliasChoices, Field, create_model, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.options import EngineOptions
from producer import protocol
from producer.client import URL_VARIABLES

def default_redis_data_dir() -> str:
    """Where an embedded redis-server keeps its data: this user's XDG data folder."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return os.path.join(base, "redline", "redis")


class _WorkerSettings(BaseSettings):
    """The worker's own settings; the engine's options join them below."""

    model_config = SettingsConfigDict(env_prefix="REDLINE_", extra="ignore", protected_namespaces=())

    model: str | None = Field(None, description="HF hub id or local model directory (required)")
    redis_url: str | None = Field(None, validation_alias=AliasChoices("redis_url", *URL_VARIABLES),
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
    cache_aware_admission: bool = Field(False, description="read jobs ahead of the engine's room and start first "
                                                           "those whose prompt prefix is cached (the engine "
                                                           "prefers them too: --prefer-cached-prefixes)")
    lookahead: int | None = Field(None, ge=1, description="with --cache-aware-admission: jobs read ahead of the "
                                                          "engine's room [4 x max_num_seqs]")
    admission_max_wait: float = Field(300.0, gt=0, description="with --cache-aware-admission: the longest a job "
                                                              "read ahead waits past its turn in arrival order "
                                                              "while others go first")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    celery_queue: str | None = Field(None, min_length=1,
                                     description="also serve this Celery queue (tasks 'redline.generate' sent by "
                                                 "Celery producers to the same Redis; results in Celery's backend)")
    celery_visibility_timeout: float = Field(60.0, gt=0, description="a Celery task whose worker has not been heard "
                                                                     "from this long goes back to its queue")
    lora: list[str] = Field(default_factory=list,
                            description="a LoRA adapter jobs may name (`lora: NAME`): NAME=PATH of a PEFT adapter "
                                        "directory; repeatable (REDLINE_LORA: a JSON list); turns on enable_lora")

    @field_validator("lora")
    @classmethod
    def _check_lora(cls, value: list[str]) -> list[str]:
        names = [lora_name_and_path(entry)[0] for entry in value]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"adapter name {twice[0]!r} is given twice")
        return value

    @property
    def lora_requests(self) -> dict:
        """The adapters jobs may name, by name: LoRARequests with ids 1, 2, ... in the order given."""
        from engine.lora.request import LoRARequest

        return {name: LoRARequest(name, i + 1, path)
                for i, (name, path) in enumerate(lora_name_and_path(entry) for entry in self.lora)}

    @property
    def engine_kwargs(self) -> dict:
        """The engine options given (a flag or REDLINE_<NAME>); the others keep the engine's defaults."""
        given = {k: getattr(self, k) for k in ENGINE_FIELDS if getattr(self, k) is not None}
        if self.cache_aware_admission:  # the engine's half of it, unless set on its own
            given.setdefault("prefer_cached_prefixes", True)
        if self.lora:
            given.setdefault("enable_lora", True)
        return given


def lora_name_and_path(entry: str) -> tuple[str, str]:
    """(NAME, PATH) of a `--lora NAME=PATH` entry; ValueError in one line otherwise."""
    name, sep, path = entry.partition("=")
    if not sep or not path or not re.fullmatch(protocol.LORA_NAME_PATTERN, name) \
            or len(name) > protocol.MAX_LORA_NAME_CHARS:
        raise ValueError(f"give NAME=PATH (NAME: letters, digits, '.', '_', '-', at most "
                         f"{protocol.MAX_LORA_NAME_CHARS}), got {entry!r}")
    return name, path


def _engine_fields() -> dict:
    """Each option of engine/options.py as an optional setting (unset: the engine's default), with its help
    and default."""
    hints = get_type_hints(EngineOptions)
    out = {}
    for f in fields(EngineOptions):
        if f.name in ENGINE_FIELDS:
            default = "" if f.default is None else f" [{f.default}]"
            out[f.name] = (hints[f.name] | None, Field(None, description=f.metadata["help"] + default))
    return out


# the engine options, each a setting: passed to the engine as keyword arguments when set
ENGINE_FIELDS = tuple(f.name for f in fields(EngineOptions) if f.name != "model")
WorkerSettings = create_model("WorkerSettings", __base__=_WorkerSettings, __module__=__name__, **_engine_fields())
WorkerSettings.__doc__ = "The worker's settings and the engine's options: flags, then REDLINE_<NAME>, then defaults."


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
        if get_origin(field.annotation) is list:  # repeatable
            parser.add_argument(flag, dest=name, default=None, action="append", help=help_text)
        elif kinds and kinds[0] is bool:
            parser.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, type=kinds[0] if kinds else str, help=help_text)


def from_args(args: argparse.Namespace) -> WorkerSettings:
    """Settings from parsed flags; a flag left unset falls back to REDLINE_<NAME>, then the default."""
    given = {k: v for k, v in vars(args).items() if k in WorkerSettings.model_fields and v is not None}
    return WorkerSettings(**given)
