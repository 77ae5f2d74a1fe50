"""Gateway settings: `redline serve` flags, then environment variables (REDLINE_<NAME>), then defaults."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from producer.client import URL_VARIABLES

MiB = 1024 * 1024


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REDLINE_", extra="ignore", protected_namespaces=())

    redis_url: str | None = Field(None, validation_alias=AliasChoices("redis_url", *URL_VARIABLES),
                                  description="the queue's Redis; unset: as `redline submit` finds it")
    redis_password: str | None = Field(None, description="Redis password when the URL has none")
    queue: str = Field("default", description="queue the gateway submits to")
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="bearer keys a request must carry (none: no check); "
                                          "REDLINE_API_KEYS takes them comma-separated")
    model_name: str = Field("redline", min_length=1,
                            description="the model name /v1/models lists and responses carry (the workers' model)")
    lora: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="LoRA adapter names the workers serve (their --lora NAME=PATH): /v1/models "
                                          "lists them and a request's `model` may name one; REDLINE_LORA takes them "
                                          "comma-separated")
    max_file_bytes: int = Field(100 * MiB, ge=1024, description="largest file POST /v1/files takes")
    max_request_bytes: int = Field(4 * MiB, ge=1024, description="largest body of any other request")
    request_timeout: float = Field(600.0, gt=0, description="an online request without a result this long after "
                                                           "it was enqueued is cancelled and answered 504")
    header_timeout: float = Field(10.0, gt=0, le=3600, description="a connection whose request head has not arrived "
                                                                   "whole this many seconds after it began is closed")
    body_timeout: float = Field(30.0, gt=0, le=3600, description="a request body that has not arrived whole this many "
                                                                 "seconds after its head, plus a second per 64 KiB "
                                                                 "of it, is answered 408 and its connection closed")
    max_connections: int = Field(1000, ge=1, le=1_000_000,
                                 description="client connections open at once; past it a new one takes the place of "
                                             "the one waiting longest for a request head, else is answered 503")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")

    @field_validator("api_keys", "lora", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value
