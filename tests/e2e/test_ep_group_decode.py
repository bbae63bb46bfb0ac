"""A decode-only worker group behind a plain prefill worker: `--layout split` with one prefill worker
(a single process) and one decode worker that is a group of 2 ranks (FERRY_EP_SIZE=2 on it alone),
serving the tiny DeepSeek-V3 checkpoint. Every prompt's KV is computed by the prefill worker, goes
through the store, and is decoded on whichever rank of the group it is dealt to. Streamed greedy
completions, several at once, equal the single-process engine's text, and both ranks decode."""

from __future__ import annotations

import asyncio

import nats
import openai
import pytest
from system_launch import plan_up
from test_ep_group_faults import ENV, reference_texts

from ferry.launcher.servers import free_port
from ferry.launcher.up import spawn, stop_children, wait_ready
from ferry.protocol import LoadReport, decode

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 32
PROMPTS = ["hello there", "the quick brown fox jumps over the lazy dog", "ferry", "a b c d e f g h i j k l m n"]


async def test_a_decode_group_behind_a_prefill_worker_streams_the_single_process_text(ds_model, servers, tmp_path):
    nats_server, redis_server = servers
    port = free_port()
    specs = plan_up(
        ["--model", str(ds_model), "--layout", "split", "--prefill-workers", "1", "--decode-workers", "1"]
        + ["--port", str(port), "--num-kv-blocks", "256", "--max-running", "8", "--torch-threads", "1"],
        ds_model,
        nats_server.url,
        redis_server.url,
    )
    (prefill,) = [s for s in specs if s.env.get("FERRY_ROLE") == "prefill"]
    (group,) = [s for s in specs if s.env.get("FERRY_ROLE") == "decode"]
    group.env["FERRY_EP_SIZE"] = "2"
    assert "FERRY_EP_SIZE" not in prefill.env
    children = []
    for spec in specs:
        spec.env.update(ENV)
        children.append(spawn(spec, tmp_path))
    base_url = f"http://127.0.0.1:{port}"
    try:
        assert wait_ready(children, base_url, 240) == ""
        expected = reference_texts(ds_model, PROMPTS, MAX_TOKENS)
        nc = await nats.connect(nats_server.url)
        reports: list[LoadReport] = []
        watch = asyncio.create_task(_collect(nc, f"ferry.load.decode.{group.worker_id}", reports))
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=90)
        texts = await asyncio.gather(*(_streamed(client, ds_model.name, p) for p in PROMPTS))
        await client.close()
        watch.cancel()
        await nc.close()
        assert texts == expected
        assert {len(r.ranks) for r in reports} == {2}, "the decode worker is a group of 2 ranks"
        assert {rank.rank for r in reports for rank in r.ranks if rank.num_running} == {0, 1}, "both decode"
    finally:
        stop_children(children)


async def _streamed(client: openai.AsyncOpenAI, model: str, prompt: str) -> str:
    stream = await client.completions.create(
        model=model, prompt=prompt, stream=True, temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
    )
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


async def _collect(nc, subject: str, into: list[LoadReport]) -> None:
    """Appends every load report on subject to into (until cancelled)."""
    sub = await nc.subscribe(subject)
    try:
        async for msg in sub.messages:
            into.append(decode(msg.data, LoadReport))
    finally:
        await sub.unsubscribe()
