"""A worker's work in `nats micro stats`, per replica: the `work` input counts pulled messages (pull to
settle), bad ones as errors, and its data carries steps, tokens, batch size, backlog and KV usage."""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.micro.service import ServiceStats
from test_worker_pipeline import GREEDY, PROMPTS, Client, System

from ferry.protocol import subjects

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ferry.model.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny") / "tiny", "llama", "tiny")


@pytest.fixture
async def system(nc, nats_url, redis_url, redis, tiny_model):
    system = System(nats_url, redis_url, tiny_model)
    await system.start()
    await system.until_reported()
    yield system
    await system.stop()


async def work_endpoint(nc, worker) -> dict:
    """The `work` endpoint of this very replica ($SRV.STATS.<name>.<id>), as the `nats` CLI gets it."""
    reply = await nc.request(f"$SRV.STATS.{worker.service.name}.{worker.service.id}", b"", timeout=2)
    stats = json.loads(reply.data)
    ServiceStats.from_dict(stats)
    return {e["name"]: e for e in stats["endpoints"]}["work"]


async def test_each_workers_micro_stats_show_the_work_it_pulled_and_did(nc, js, system):
    client = Client(nc)
    await client.start()
    replies = [await client.submit(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    assert all(r.accepted for r in replies), replies
    await client.wait_finished([f"r{i}" for i in range(len(PROMPTS))])
    assert client.errors == []

    for worker in system.workers.values():
        work = await work_endpoint(nc, worker)
        assert work["subject"] == subjects.work(worker.role, worker.worker_id)
        assert (work["num_requests"], work["num_errors"]) == (len(PROMPTS), 0)  # each message pulled and settled
        assert work["average_processing_time"] > 0
        data = work["data"]
        assert data["num_steps"] > 0 and data["mean_batch_size"] >= 1
        assert (data["num_running"], data["num_backlog"], data["kv_blocks_total"]) == (0, 0, 64)
        assert data["kv_usage"] == data["kv_blocks_used"] / 64
    decode_data = (await work_endpoint(nc, system.workers["decode-t"]))["data"]
    # the prefill worker samples each request's first token; the decode worker the other 11
    assert decode_data["num_generated_tokens"] == len(PROMPTS) * (GREEDY.max_tokens - 1)

    # a message that is not work is one error there, named, and the worker pulls on
    worker = system.workers["decode-t"]
    await js.publish(subjects.work("decode", "decode-t"), b"\xc1 not msgpack", stream=subjects.WORK_STREAM)
    for _ in range(100):
        work = await work_endpoint(nc, worker)
        if work["num_errors"]:
            break
        await asyncio.sleep(0.05)
    assert (work["num_requests"], work["num_errors"]) == (len(PROMPTS) + 1, 1)
    assert work["last_error"] == "bad_request: a message on decode-decode-t is not a Handoff"
