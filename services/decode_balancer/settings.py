"""decode-balancer settings, from `FERRY_*` environment variables (the shared ones: `BalancerSettings`)."""

from pydantic import Field

from ferry.balancing.settings import BalancerSettings


class DecodeBalancerSettings(BalancerSettings):
    kv_weight: float = Field(default=1.0, ge=0, description="weight of KV-cache usage in the score")
    seqs_weight: float = Field(default=1.0, ge=0, description="weight of batch fill in the score")
    affinity_weight: float = Field(
        default=0.5,
        ge=0,
        description="session affinity: score credit of the worker holding a sequence's whole KV chain from an "
        "earlier turn (load can outweigh it; 0 = off)",
    )
    retry_after_s: float = Field(default=0.5, gt=0, description="what an 'overloaded' reply asks to wait")
