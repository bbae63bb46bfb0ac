"""worker: runs the engine for one role (`FERRY_ROLE=prefill|decode|both`; both: see both.py).

Reads `ferry.work.<role>.<id>` (JetStream FERRY_WORK, durable pull consumer `<role>-<id>`) and
`ferry.cancel`; writes `ferry.out.<gateway>` (token events, one OutputBatch per gateway per
step), `ferry.load.<role>.<id>` (every FERRY_LOAD_INTERVAL_S) and, for prefill, `ferry.handoff`
(request/reply; a decode worker too, for what it hands on at shutdown). KV blocks travel through
Redis (`ferry.kvstore`), never over NATS. The durable consumer is created before the model loads,
so an autoscaler counting the consumer's pending messages never sees a replica without one.
"""

from __future__ import annotations

import asyncio
import logging

from ferry.bus import connect, ensure_work_stream, run_service
from ferry.kvstore import KvStore, RedisTransport
from ferry.metrics import start_metrics_server
from ferry_services.worker.base import Worker, open_work_consumer
from ferry_services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def build_engine(settings: WorkerSettings):
    """Load the checkpoint into an engine of this worker's role (slow: run it off the loop)."""
    from ferry.engine import EngineConfig, LLMEngine

    config = EngineConfig(
        block_size=settings.block_size,
        num_kv_blocks=settings.num_kv_blocks,
        max_num_seqs=settings.max_running,
        max_num_batched_tokens=max(settings.max_batch_tokens, settings.max_running),
        role=settings.role,
        device=settings.device,
        dtype=settings.dtype or None,
        kv_cache_dtype=settings.kv_cache_dtype or None,
    )
    return LLMEngine.from_model_path(settings.model, config)


def make_worker(nc, settings: WorkerSettings, engine, store) -> Worker:
    if settings.role == "both":
        from ferry_services.worker.both import BothWorker

        return BothWorker(nc, settings, engine, store)
    if settings.role == "prefill":
        from ferry_services.worker.prefill import PrefillWorker

        return PrefillWorker(nc, settings, engine, store)
    from ferry_services.worker.decode import DecodeWorker

    return DecodeWorker(nc, settings, engine, store)


async def serve(settings: WorkerSettings) -> int:
    """Run one worker until SIGTERM/SIGINT; the exit status."""
    if not settings.model:
        raise SystemExit("ferry worker: FERRY_MODEL must name a checkpoint folder")
    nc = await connect(settings.nats_url, f"worker-{settings.worker_id}")
    await ensure_work_stream(nc.jetstream(), replicas=settings.work_replicas)
    consumer = await open_work_consumer(nc.jetstream(), settings)  # before the (slow) model load
    engine = await asyncio.to_thread(build_engine, settings)
    log.info(
        "%s worker %s: model %s (%s), %d KV blocks",
        settings.role,
        settings.worker_id,
        settings.model,
        engine.kv_namespace,
        engine.stats().kv_blocks_total,
    )
    transport = RedisTransport(settings.redis_url)
    worker = make_worker(nc, settings, engine, KvStore(transport, engine.kv_namespace))
    await worker.start(consumer)
    start_metrics_server(settings.metrics_port)
    try:
        return await run_service(nc, worker.service, background=worker.background(), on_shutdown=worker.shutdown)
    finally:
        await transport.close()
