"""decode-balancer settings, from `FERRY_*` environment variables."""

from pydantic import Field

from ferry.settings import ServiceSettings


class DecodeBalancerSettings(ServiceSettings):
    kv_weight: float = Field(default=1.0, ge=0, description="weight of KV-cache usage in the score")
    seqs_weight: float = Field(default=1.0, ge=0, description="weight of batch fill in the score")
    retry_after_s: float = Field(default=0.5, gt=0, description="what an 'overloaded' reply asks to wait")
    silent_after_intervals: float = Field(
        default=3.0, gt=1, description="report intervals without a report before a worker is silent"
    )
    tick_s: float = Field(default=0.5, gt=0, description="how often silent workers are looked for")
