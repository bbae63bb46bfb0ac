"""Gateway settings, read from `FERRY_*` environment variables."""

from __future__ import annotations

from pydantic import Field

from ferry.model.source import served_name
from ferry.settings import ServiceSettings, default_instance_id


class GatewaySettings(ServiceSettings):
    model: str = Field(
        min_length=1, description="checkpoint folder, .gguf file or smollm2; only config and tokenizer are read"
    )
    served_model_name: str = Field(default="", description="model name clients use; default: folder name")
    gateway_id: str = Field(
        default_factory=default_instance_id,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="names this gateway's ferry.out.<id> subject; unique per replica",
    )
    http_host: str = Field(
        default="127.0.0.1", description="listen address; a non-loopback one needs API keys or FERRY_ALLOW_OPEN=1"
    )
    http_port: int = Field(default=8000, ge=0, le=65535)
    request_timeout_s: float = Field(
        default=120.0, gt=0, description="a request that hears nothing for this long fails"
    )
    submit_timeout_s: float = Field(default=5.0, gt=0, description="wait for the balancer's answer")
    max_inflight: int = Field(default=1024, ge=1, description="admission: requests in flight at once")
    retry_after_s: float = Field(default=1.0, ge=0, description="Retry-After sent with a 429")
    max_context_len: int = Field(
        default=0, ge=0, description="prompt + max_tokens limit; 0 = the model's max_position_embeddings"
    )
    api_keys: str = Field(default="", repr=False, description="accepted Bearer keys, comma separated; none = open")
    allow_open: bool = Field(
        default=False, description="serve without API keys on a non-loopback FERRY_HTTP_HOST (on purpose)"
    )
    api_key_file: str = Field(default="", description="file with one accepted key per line (adds to api_keys)")
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1, description="larger request bodies get 413")
    sched_batch_from: int = Field(
        default=0,
        ge=0,
        description="Linux: from this many open streams the event loop thread runs SCHED_BATCH (back to the normal "
        "policy under half of it), so that on a box whose cores the workers fill its wake-ups do not preempt their "
        "OpenMP threads (ferry.sched); `ferry up` sets 4 on small machines. 0: never",
    )
    max_attempts: int = Field(default=3, ge=1, description="tries per request, migrations included")
    tpot_slo_ms: float = Field(default=0.0, ge=0, description="TPOT target of ferry_slo_requests; 0 = not counted")
    ttft_slo_ms: float = Field(default=2000.0, gt=0, description="TTFT target of ferry_slo_requests_total")
    forecast_interval_s: float = Field(default=60.0, gt=0, description="arrivals are counted per interval of this")
    forecast_season_intervals: int = Field(default=1440, ge=1, description="intervals in one day (Holt-Winters)")
    forecast_publish_s: float = Field(default=5.0, gt=0, description="seconds between published forecasts")

    @property
    def model_name(self) -> str:
        """The name clients send in `model`."""
        return self.served_model_name or served_name(self.model) or "ferry"
