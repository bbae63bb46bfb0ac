"""kvcache settings, from `FERRY_*` environment variables."""

from pydantic import Field

from ferry.settings import ServiceSettings

EVICTION_POLICIES = (
    "allkeys-lru",
    "volatile-lru",
    "allkeys-lfu",
    "volatile-lfu",
    "allkeys-random",
    "volatile-random",
    "volatile-ttl",
    "noeviction",
)


class KvCacheSettings(ServiceSettings):
    kv_max_memory: str = Field(
        default="",
        pattern=r"^(|\d+([kKmMgG][bB]?|[bB])?)$",
        description="Redis maxmemory set on start, e.g. '2gb'; '' keeps Redis's own",
    )
    kv_eviction_policy: str = Field(
        default="allkeys-lru",
        pattern="^(" + "|".join(EVICTION_POLICIES) + ")$",
        description="Redis maxmemory-policy set on start",
    )
    kv_redis_timeout_s: float = Field(default=2.0, gt=0, description="connect and reply timeout for Redis")
    kv_health_interval_s: float = Field(
        default=1.0, gt=0, description="Redis ping interval, and the retry interval while it is down"
    )
    kv_event_flush_s: float = Field(default=0.02, gt=0, description="how long KV events are batched before publishing")
