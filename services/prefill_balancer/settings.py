"""prefill-balancer settings, from `FERRY_*` environment variables."""

from pydantic import Field

from ferry.settings import ServiceSettings


class PrefillBalancerSettings(ServiceSettings):
    max_queued_tokens: int = Field(
        default=32768, ge=1, description="prefill tokens queued on a worker before it takes no more"
    )
    attention_weight: float = Field(default=1.0 / 2048, ge=0, description="token-equivalents per causal query-key pair")
    retry_after_s: float = Field(default=1.0, gt=0, description="what an 'overloaded' reply asks clients to wait")
    silent_after_intervals: float = Field(
        default=3.0, gt=1, description="report intervals without a report before a worker is silent"
    )
    tick_s: float = Field(default=0.5, gt=0, description="how often silent workers are looked for")
