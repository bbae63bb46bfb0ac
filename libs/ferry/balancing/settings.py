"""Settings every balancer has, from `FERRY_*` environment variables; each balancer adds its policy's."""

from pydantic import Field

from ferry.settings import ServiceSettings


class BalancerSettings(ServiceSettings):
    silent_after_intervals: float = Field(
        default=3.0, gt=1, description="report intervals without a report before a worker is silent"
    )
    tick_s: float = Field(default=0.5, gt=0, description="how often silent workers are looked for")
    forecast_interval_s: float = Field(default=60.0, gt=0, description="arrivals are counted per interval of this")
    forecast_season_intervals: int = Field(default=1440, ge=1, description="intervals in one day (Holt-Winters)")
    forecast_publish_s: float = Field(default=5.0, gt=0, description="seconds between published forecasts")
