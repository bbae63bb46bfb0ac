"""Settings every balancer has, from `FERRY_*` environment variables; each balancer adds its policy's."""

from pydantic import Field

from ferry.settings import ServiceSettings


class BalancerSettings(ServiceSettings):
    silent_after_intervals: float = Field(
        default=3.0, gt=1, description="report intervals without a report before a worker is silent"
    )
    tick_s: float = Field(default=0.5, gt=0, description="how often silent workers are looked for")
