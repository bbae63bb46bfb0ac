"""`ferry up --ep-size 2`: a both-role worker that is a group of 2 rank processes holding the tiny
DeepSeek-V3 checkpoint (routed experts split, each rank its own sequences and KV pool). Through the
whole system, greedy text equals the single-process engine's, the group is one worker on micro
with its ranks' pids, and its load reports carry each rank's load."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from system_launch import pid_alive, start_system
from test_system_openai import GREEDY, async_client

from ferry.protocol import LoadReport, decode

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["hello there", "the quick brown fox jumps over the lazy dog", "ferry", "a b c d e f g h i j k l m n"]


@pytest.fixture(scope="module")
def reference(ds_model):
    from ferry.engine.config import EngineConfig
    from ferry.engine.generate_cli import generate
    from ferry.engine.llm_engine import LLMEngine
    from ferry.protocol import SamplingParams

    engine = LLMEngine.from_model_path(ds_model, EngineConfig(num_kv_blocks=256))
    sampling = SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0, ignore_eos=True)
    return [r["text"] for r in generate(engine, list(PROMPTS), sampling)]


@pytest.fixture(scope="module")
def group_system(ds_model, nats_url, redis_url, tmp_path_factory):
    running = start_system(ds_model, nats_url, redis_url, tmp_path_factory.mktemp("run-ep"), both=1, ep_size=2)
    yield running
    assert running.stop() == 0
    assert [name for name, pid in running.pids.items() if pid_alive(pid)] == []


async def test_a_group_serves_the_single_process_greedy_text(group_system, reference, nats_url):
    client = async_client(group_system)
    results = await asyncio.gather(
        *(client.completions.create(model=group_system.model_name, prompt=p, **GREEDY) for p in PROMPTS)
    )
    await client.close()
    assert [r.choices[0].text for r in results] == reference

    nc = await nats.connect(nats_url)
    try:
        report = decode((await _next(nc, "ferry.load.>")).data, LoadReport)
        infos = await _micro_infos(nc)
    finally:
        await nc.close()
    assert [r.rank for r in report.ranks] == [0, 1]
    assert report.kv_blocks_total == sum(r.kv_blocks_total for r in report.ranks)
    assert report.max_running == sum(r.max_running for r in report.ranks)
    workers = [i for i in infos if i.get("metadata", {}).get("worker_id") == report.worker_id]
    assert len(workers) == 1  # one worker on micro, not one per rank
    pids = [int(p) for p in workers[0]["metadata"]["rank_pids"].split(",")]
    assert workers[0]["metadata"]["ep_size"] == "2" and len(set(pids)) == 2 and all(map(pid_alive, pids))


async def _next(nc, subject: str, timeout_s: float = 10.0):
    sub = await nc.subscribe(subject)
    try:
        return await sub.next_msg(timeout=timeout_s)
    finally:
        await sub.unsubscribe()


async def _micro_infos(nc, wait_s: float = 1.0) -> list[dict]:
    """Every micro service's $SRV.INFO reply."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.INFO", b"", reply=inbox)
    infos = []
    try:
        while True:
            infos.append(json.loads((await sub.next_msg(timeout=wait_s)).data))
    except nats.errors.TimeoutError:
        return infos
    finally:
        await sub.unsubscribe()
