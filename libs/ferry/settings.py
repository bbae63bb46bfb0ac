"""Settings shared by every service: one pydantic-settings class per service, read from `FERRY_*`.

Each service subclasses `ServiceSettings` in its own `settings.py` and loads it with
`load_settings(cls)`, which turns a bad value into one line naming the environment variable:

    ferry: invalid FERRY_MAX_RUNNING='lots': Input should be a valid integer
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any, TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

S = TypeVar("S", bound="ServiceSettings")

ENV_PREFIX = "FERRY_"


def default_instance_id() -> str:
    """Unique per replica (compose --scale, k8s pods): hostname plus a short random suffix."""
    host = "".join(c if c.isalnum() else "-" for c in socket.gethostname())[:24] or "host"
    return f"{host}-{uuid.uuid4().hex[:6]}"


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    nats_url: str = Field(default="nats://127.0.0.1:4222", description="NATS server URL(s), comma separated")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis URL for the KV store")
    log_level: str = Field(default="INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$")
    log_json: bool = Field(default=False, description="structured JSON log lines")
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus /metrics port; 0 = off")
    work_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="replicas of the FERRY_WORK JetStream stream (3 on a 3-node NATS cluster); "
        "an existing stream with more replicas keeps them",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_log_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


class SettingsError(SystemExit):
    """Raised at start when an environment variable holds an invalid value."""


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Read `cls` from the environment (plus explicit overrides), or exit naming the bad variable."""
    try:
        return cls(**overrides)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else "?"
            var = ENV_PREFIX + field.upper()
            shown = os.environ.get(var, overrides.get(field, err.get("input")))
            problems.append(f"invalid {var}={shown!r}: {err['msg']}")
        raise SettingsError("ferry: " + "; ".join(problems)) from None
