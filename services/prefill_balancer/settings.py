"""prefill-balancer settings, from `FERRY_*` environment variables (the shared ones: `BalancerSettings`)."""

from pydantic import Field

from ferry.balancing.settings import BalancerSettings


class PrefillBalancerSettings(BalancerSettings):
    max_queued_tokens: int = Field(
        default=32768, ge=1, description="prefill tokens queued on a worker before it takes no more"
    )
    attention_weight: float = Field(default=1.0 / 2048, ge=0, description="token-equivalents per causal query-key pair")
    retry_after_s: float = Field(default=1.0, gt=0, description="what an 'overloaded' reply asks clients to wait")
    device_tier_weight: float = Field(
        default=1.0, ge=0, le=1, description="routing credit of a prompt block in a worker's KV pool"
    )
    host_tier_weight: float = Field(
        default=0.75, ge=0, le=1, description="routing credit of a prompt block in a worker's host memory tier"
    )
    remote_tier_weight: float = Field(
        default=0.25, ge=0, le=1, description="routing credit of a prompt block only in the shared KV store"
    )
    kv_prefetch: bool = Field(
        default=True,
        description="ask the chosen worker to fetch the prompt's blocks that only the KV store holds into its "
        "host tier while the request is queued",
    )
    max_prefetch_blocks: int = Field(default=256, ge=1, description="most blocks one prefetch asks for")
