"""How much of the workers' KV transfer time hides behind engine compute (the services' side of
ferry.bench.prefix; ops wires services, the library never imports them).

Runs both balancers, one prefill and one decode worker in this process over real NATS and Redis
(the integration tests' wiring) and reads each worker's timeline (ferry.bench.prefix.timeline).
"""

from __future__ import annotations

import asyncio
import random
import time

from ferry.bench.prefix.timeline import RecordingStore, Timeline, record_steps
from ferry.bus import connect, ensure_work_stream
from ferry.kvstore import KvStore, RedisTransport
from ferry.protocol import GenerateRequest, OutputBatch, SamplingParams, SubmitRequest, decode, encode, subjects
from ferry_services.decode_balancer.service import DecodeBalancer
from ferry_services.decode_balancer.settings import DecodeBalancerSettings
from ferry_services.prefill_balancer.service import PrefillBalancer
from ferry_services.prefill_balancer.settings import PrefillBalancerSettings
from ferry_services.worker.service import build_engine, make_worker
from ferry_services.worker.settings import WorkerSettings


async def measure_overlap(
    model_dir: str, nats_url: str, redis_url: str, num_requests: int = 16, max_tokens: int = 32, seed: int = 0
) -> dict:
    conns, tasks, closers, workers = [], [], [], {}
    timelines = {"prefill": Timeline(), "decode": Timeline()}
    for cls, settings in (
        (PrefillBalancer, PrefillBalancerSettings(tick_s=0.2)),
        (DecodeBalancer, DecodeBalancerSettings(tick_s=0.2)),
    ):
        nc = await connect(nats_url, "bench-balancer")
        conns.append(nc)
        await ensure_work_stream(nc.jetstream())
        balancer = cls(nc, settings)
        await balancer.start()
        closers.append(balancer.stop)
    for role in ("prefill", "decode"):
        settings = WorkerSettings(
            role=role,
            model=model_dir,
            worker_id=f"{role}-bench",
            num_kv_blocks=1024,
            max_running=16,
            load_interval_s=0.2,
            redis_url=redis_url,
        )
        engine = await asyncio.to_thread(build_engine, settings)
        nc = await connect(nats_url, f"bench-{role}")
        conns.append(nc)
        transport = RedisTransport(redis_url)
        closers.append(transport.close)
        worker = make_worker(
            nc, settings, engine, RecordingStore(KvStore(transport, engine.kv_namespace), timelines[role])
        )
        record_steps(worker, timelines[role])
        await worker.start()
        await worker.service.start(nc)
        tasks += [asyncio.create_task(c) for c in worker.background()]
        workers[role] = worker
    await asyncio.sleep(0.6)  # first load reports reach the balancers

    client = await connect(nats_url, "bench-client")
    conns.append(client)
    finished: set[str] = set()

    async def on_output(msg) -> None:
        finished.update(e.request_id for e in decode(msg.data, OutputBatch).tokens if e.finish_reason)

    await client.subscribe(subjects.out("gw"), cb=on_output)
    rng = random.Random(seed)
    vocab = workers["prefill"].engine.lm.config.vocab_size
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i in range(num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(128, 512))]
        request = GenerateRequest(
            request_id=f"o{i}", gateway_id="gw", model="bench", prompt_token_ids=prompt, sampling=sampling
        )
        await client.request(subjects.SUBMIT, encode(SubmitRequest(request)), timeout=10)
    while len(finished) < num_requests and time.perf_counter() - start < 300:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    elapsed = time.perf_counter() - start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for worker in workers.values():
        worker.compute.close()
    for close in closers:
        await close()
    for nc in conns:
        await nc.close()
    return {
        "num_requests": num_requests,
        "num_finished": len(finished),
        "elapsed_s": elapsed,
        **{role: t.summary() for role, t in timelines.items()},
    }
