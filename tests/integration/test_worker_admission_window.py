"""The admission window (services/worker/window.py) on a real both-roles worker over nats-server: a
burst queued in JetStream, pulled one message at a time (as it trickles in over HTTP), is prefilled in
one engine step; without the window the first step runs the first prompt alone."""

from __future__ import annotations

import asyncio

import pytest
from waiting import wait_until

from ferry.bus import ensure_work_stream, publish_work
from ferry.kvstore import KvStore, RedisTransport
from ferry.protocol import GenerateRequest, PrefillWork, SamplingParams
from ferry_services.worker import pulling
from ferry_services.worker.service import build_engine, make_worker
from ferry_services.worker.settings import WorkerSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_REQUESTS = 6
SAMPLING = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ferry.model.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny") / "tiny", "llama", "tiny")


@pytest.mark.parametrize(("window_ms", "first_step_seqs"), [(500.0, NUM_REQUESTS), (0.0, 1)])
async def test_a_burst_pulled_one_by_one_is_prefilled_together(
    nc, redis_url, tiny_model, monkeypatch, window_ms, first_step_seqs
):
    monkeypatch.setattr(pulling, "MAX_FETCH", 1)  # one message per pull: the burst arrives one by one
    settings = WorkerSettings(
        role="both",
        model=str(tiny_model),
        worker_id="window-t",
        redis_url=redis_url,
        num_kv_blocks=64,
        max_running=8,
        kv_writeback=False,
        admission_window_ms=window_ms,
    )
    js = nc.jetstream()
    await ensure_work_stream(js)
    engine = await asyncio.to_thread(build_engine, settings)
    transport = RedisTransport(redis_url)
    worker = make_worker(nc, settings, engine, KvStore(transport, engine.kv_namespace))
    await worker.start()
    step_sizes: list[int] = []
    finished: set[str] = set()
    step = worker.step

    def recorded_step():  # on the engine thread
        outputs = step()
        if outputs:
            step_sizes.append(engine.last_step.num_seqs)
        finished.update(out.request_id for out in outputs if out.finish_reason is not None)
        return outputs

    worker.step = recorded_step
    for i in range(NUM_REQUESTS):  # queued before the worker pulls: the first pull sees the rest behind it
        request = GenerateRequest(f"w{i}", "gw-window", "tiny", list(range(3, 12 + i)), SAMPLING)
        await publish_work(js, "prefill", "window-t", PrefillWork(request))
    tasks = [asyncio.create_task(loop) for loop in worker.background()]
    try:
        await wait_until(lambda: len(finished) == NUM_REQUESTS, "every request finished", 30)
        assert step_sizes[0] == first_step_seqs
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        worker.compute.close()
        await transport.close()
