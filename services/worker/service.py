"""worker: runs the engine for one role (`FERRY_ROLE=prefill|decode|both`; both: see both.py).

Reads `ferry.work.<role>.<id>` (JetStream FERRY_WORK, durable pull consumer `<role>-<id>`) and
`ferry.cancel`; writes `ferry.out.<gateway>` (token events, one OutputBatch per gateway per
step), `ferry.load.<role>.<id>` (every FERRY_LOAD_INTERVAL_S) and, for prefill, `ferry.handoff`
(request/reply; a decode worker too, for what it hands on at shutdown). KV blocks travel through
Redis (`ferry.kvstore`), never over NATS. The durable consumer is created before the model loads,
so an autoscaler counting the consumer's pending messages never sees a replica without one.
"""

from __future__ import annotations

import logging

from ferry.bus import connect, ensure_work_stream, run_service
from ferry.kvstore import KvStore, RedisTransport
from ferry.metrics import start_metrics_server
from ferry_services.worker.base import Worker, open_work_consumer
from ferry_services.worker.compute import ComputeThread
from ferry_services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def build_engine(settings: WorkerSettings):
    """Load the checkpoint into an engine of this worker's role (slow: run it off the loop)."""
    from ferry.engine import EngineConfig, LLMEngine

    config = EngineConfig(
        block_size=settings.block_size,
        num_kv_blocks=settings.num_kv_blocks,
        host_cache_blocks=settings.host_kv_blocks,
        max_num_seqs=settings.max_num_seqs or settings.max_running,
        max_num_batched_tokens=max(settings.max_batch_tokens, settings.max_num_seqs or settings.max_running),
        role=settings.role,
        device=settings.device,
        dtype=settings.dtype or None,
        weights_dtype=settings.weights_dtype,
        kv_cache_dtype=settings.kv_cache_dtype or None,
    )
    try:
        if settings.ep_size > 1:
            from ferry_services.worker.group import start_group

            engine = start_group(settings, config)
        else:
            engine = LLMEngine.from_model_path(settings.model, config)
    except (FileNotFoundError, ValueError) as exc:  # a bad checkpoint: one clear line, no traceback
        raise SystemExit(f"ferry worker: FERRY_MODEL {settings.model}: {exc}") from None
    engine.warmup()  # kernels compiled and decode graphs captured before the first pull
    return engine


def check_model(model: str) -> None:
    """Refuse a checkpoint ferry cannot run before touching NATS: its config (a GGUF: its architecture and
    every tensor's type, read once and kept for the load)."""
    from ferry.model.config import read_config

    try:
        read_config(model)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"ferry worker: FERRY_MODEL {model}: {exc}") from None


def make_worker(nc, settings: WorkerSettings, engine, store, compute: ComputeThread | None = None) -> Worker:
    if settings.role == "both":
        from ferry_services.worker.both import BothWorker

        return BothWorker(nc, settings, engine, store, compute)
    if settings.role == "prefill":
        from ferry_services.worker.prefill import PrefillWorker

        return PrefillWorker(nc, settings, engine, store, compute)
    from ferry_services.worker.decode import DecodeWorker

    return DecodeWorker(nc, settings, engine, store, compute)


async def serve(settings: WorkerSettings) -> int:
    """Run one worker until SIGTERM/SIGINT; the exit status."""
    if not settings.model:
        raise SystemExit("ferry worker: FERRY_MODEL must name a checkpoint folder, a .gguf file or smollm2")
    check_model(settings.model)
    nc = await connect(settings.nats_url, f"worker-{settings.worker_id}")
    await ensure_work_stream(nc.jetstream(), replicas=settings.work_replicas)
    consumer = await open_work_consumer(nc.jetstream(), settings)  # before the (slow) model load
    compute = ComputeThread()
    engine = await compute.load(build_engine, settings)  # on the thread that will run every step
    log.info(
        "%s worker %s: model %s (%s), weights %s, %d KV blocks of %s, %d rank(s)",
        settings.role,
        settings.worker_id,
        settings.model,
        engine.kv_namespace,
        engine.lm.weights_dtype,
        engine.stats().kv_blocks_total,
        engine.kv_cache_dtype,
        settings.ep_size,
    )
    transport = RedisTransport(settings.redis_url)
    worker = make_worker(nc, settings, engine, KvStore(transport, engine.kv_namespace), compute)
    await worker.start(consumer)
    if settings.ep_size > 1:
        from ferry_services.worker.group import watch_group

        watch_group(worker)
    start_metrics_server(settings.metrics_port)
    try:
        code = await run_service(nc, worker.service, background=worker.background(), on_shutdown=worker.shutdown)
    finally:
        await transport.close()
    if settings.ep_size > 1:  # rank 0's layers still hold the group: see ferry.parallel.lockstep.leave_group
        from ferry.parallel.lockstep import exit_now

        logging.shutdown()
        exit_now(code)
    return code
