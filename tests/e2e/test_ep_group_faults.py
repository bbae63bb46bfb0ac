"""A worker group whose rank dies fails cleanly: two both-role workers serve the tiny DeepSeek-V3
checkpoint, one a group of 2 ranks (FERRY_EP_SIZE=2), one a single process. Rank 1 of the group is
SIGKILLed while greedy streams run through it: the group exits at once (status 3, no hang), every
stream completes with the fault-free text (the gateway migrates what the group held: nothing lost,
nothing duplicated), and the group, started again under the same id, serves again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import nats
import pytest
from system_launch import plan_up
from test_faults import Outcome, stream_one

from ferry.launcher.servers import free_port
from ferry.launcher.up import spawn, stop_children, wait_ready
from ferry.protocol import LoadReport, decode

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 96
PROMPTS = [f"request {i}: " + " ".join(["the quick brown fox"] * (1 + i % 3)) for i in range(6)]
ENV = {"FERRY_LOAD_INTERVAL_S": "0.25", "FERRY_REQUEST_TIMEOUT_S": "60", "FERRY_MAX_ATTEMPTS": "3"}


def reference_texts(model_dir, prompts: list[str], max_tokens: int) -> list[str]:
    from ferry.engine.config import EngineConfig
    from ferry.engine.generate_cli import generate
    from ferry.engine.llm_engine import LLMEngine
    from ferry.protocol import SamplingParams

    engine = LLMEngine.from_model_path(model_dir, EngineConfig(num_kv_blocks=512))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [r["text"] for r in generate(engine, list(prompts), sampling)]


async def test_a_dead_rank_fails_its_group_and_every_request_completes_elsewhere(ds_model, servers, tmp_path):
    nats_server, redis_server = servers
    port = free_port()
    specs = plan_up(
        ["--model", str(ds_model), "--layout", "both", "--workers", "2", "--port", str(port)]
        + ["--num-kv-blocks", "512", "--max-running", "8", "--torch-threads", "1"],
        ds_model,
        nats_server.url,
        redis_server.url,
    )
    workers = [s for s in specs if s.kind == "worker"]
    workers[0].env["FERRY_EP_SIZE"] = "2"
    group, single = workers[0].name, workers[1].name
    children = {}
    for spec in specs:
        spec.env.update(ENV)
        children[spec.name] = spawn(spec, tmp_path)
    base_url = f"http://127.0.0.1:{port}"
    try:
        assert wait_ready(list(children.values()), base_url, 240) == ""
        expected = reference_texts(ds_model, PROMPTS, MAX_TOKENS)
        nc = await nats.connect(nats_server.url)
        rank_pids = await _rank_pids(nc, workers[0].worker_id)
        assert len(rank_pids) == 2 and rank_pids[0] == children[group].process.pid

        outcomes = [Outcome() for _ in PROMPTS]
        async with httpx.AsyncClient(base_url=base_url, timeout=90) as client:
            tasks = [
                asyncio.create_task(stream_one(client, ds_model.name, p, o, MAX_TOKENS))
                for p, o in zip(PROMPTS, outcomes)
            ]
            assert await _holds_work(nc, workers[0].worker_id), "the group never ran a request"
            os.kill(rank_pids[1], signal.SIGKILL)
            started = time.monotonic()
            assert await asyncio.to_thread(children[group].process.wait, 30) == 3  # failed, not hung
            failed_after_s = time.monotonic() - started
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert [o.error for o in outcomes] == [""] * len(PROMPTS)
        assert [o.text for o in outcomes] == expected  # migrated: nothing lost, nothing duplicated
        assert failed_after_s < 10
        assert "rank 1" in children[group].log_path.read_text(errors="replace")

        children[group] = spawn(children[group].spec, tmp_path)  # restarted under the same id
        assert await _reports_again(nc, workers[0].worker_id), "the restarted group never reported"
        children[single].process.send_signal(signal.SIGTERM)  # only the group is left to serve
        assert await asyncio.to_thread(children[single].process.wait, 60) == 0
        again = Outcome()
        async with httpx.AsyncClient(base_url=base_url, timeout=90) as client:
            await stream_one(client, ds_model.name, PROMPTS[0], again, MAX_TOKENS)
        assert again.error == "" and again.text == expected[0]
        await nc.close()
    finally:
        stop_children(list(children.values()))


async def _rank_pids(nc, worker_id: str) -> list[int]:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.INFO", b"", reply=inbox)
    try:
        while True:
            info = json.loads((await sub.next_msg(timeout=5)).data)
            if info.get("metadata", {}).get("worker_id") == worker_id:
                return [int(p) for p in info["metadata"]["rank_pids"].split(",")]
    finally:
        await sub.unsubscribe()


async def _holds_work(nc, worker_id: str, timeout_s: float = 30.0) -> bool:
    """Until a load report of the group shows sequences running on it."""
    sub = await nc.subscribe(f"ferry.load.*.{worker_id}")
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            report = decode((await sub.next_msg(timeout=timeout_s)).data, LoadReport)
            if report.num_running > 0:
                return True
        return False
    finally:
        await sub.unsubscribe()


async def _reports_again(nc, worker_id: str, timeout_s: float = 120.0) -> bool:
    sub = await nc.subscribe(f"ferry.load.*.{worker_id}")
    try:
        report = decode((await sub.next_msg(timeout=timeout_s)).data, LoadReport)
        return len(report.ranks) == 2
    finally:
        await sub.unsubscribe()
