"""Run the gateway: load the tokenizer, connect to NATS, serve HTTP with uvicorn until a signal.

Subjects: reads `ferry.out.<gateway_id>` and `ferry.load.>`; writes `ferry.submit` and `ferry.cancel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Generator

import uvicorn

from ferry.metrics import start_metrics_server
from ferry.slo import ForecastConfig
from ferry_services.gateway.app import create_app
from ferry_services.gateway.auth import ApiKeys, exposure_problem, is_loopback
from ferry_services.gateway.bus import GatewayBus
from ferry_services.gateway.convert import ModelLimits
from ferry_services.gateway.settings import GatewaySettings
from ferry_services.gateway.tokenizer import ModelInfo, load_model_info
from ferry_services.gateway.traffic import GatewayTraffic

log = logging.getLogger("ferry.gateway")


def model_limits(settings: GatewaySettings, info: ModelInfo) -> ModelLimits:
    max_len = min(settings.max_context_len or info.max_context_len, info.max_context_len)
    return ModelLimits(
        name=settings.model_name,
        max_context_len=max_len,
        vocab_size=info.vocab_size,
        arch=info.arch,
        checkpoint_dtype=info.checkpoint_dtype,
    )


class _HttpServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn would re-raise the signal after its shutdown and kill the process before the
        # bus drains; serve() routes SIGTERM/SIGINT to handle_exit itself.
        yield


async def serve(settings: GatewaySettings) -> int:
    """Serve until SIGTERM/SIGINT: in-flight responses get a few seconds, then the bus drains."""
    problem = exposure_problem(
        settings.http_host, ApiKeys.from_settings(settings.api_keys, settings.api_key_file), settings.allow_open
    )
    if problem:
        raise SystemExit(problem)
    if settings.allow_open and not is_loopback(settings.http_host):
        log.warning("FERRY_ALLOW_OPEN=1: serving WITHOUT API keys on %s", settings.http_host)
    try:
        info = load_model_info(settings.model)
    except (FileNotFoundError, ValueError) as exc:  # a bad checkpoint: one clear line, no traceback
        raise SystemExit(f"gateway: FERRY_MODEL {settings.model}: {exc}") from None
    forecast = ForecastConfig(
        interval_s=settings.forecast_interval_s, season_intervals=settings.forecast_season_intervals
    )
    traffic = GatewayTraffic(
        settings.gateway_id, settings.ttft_slo_ms, settings.tpot_slo_ms, forecast, settings.forecast_publish_s
    )
    bus = GatewayBus(settings.gateway_id, settings.submit_timeout_s, traffic, settings.sched_batch_from)
    await bus.start(settings.nats_url)
    app = create_app(settings, info.tokenizer, model_limits(settings, info), bus)
    start_metrics_server(settings.metrics_port)
    config = uvicorn.Config(
        app,
        host=settings.http_host,
        port=settings.http_port,
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    log.info(
        "gateway %s serving %s on http://%s:%d",
        settings.gateway_id,
        settings.model_name,
        settings.http_host,
        settings.http_port,
    )
    server = _HttpServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.handle_exit, sig, None)
    try:
        await server.serve()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await bus.stop()
        log.info("gateway %s stopped", settings.gateway_id)
    return 0
