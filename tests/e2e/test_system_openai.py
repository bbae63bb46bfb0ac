"""The whole system started by `ferry up` (2 prefill + 2 decode workers), driven by the official
openai SDK as a client would: sync and async, streaming and not, chat and completions; greedy
output equal to `ferry generate`; every worker used under load; a cancelled stream frees blocks."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import openai
import pytest

from ferry.protocol import LoadReport, OutputBatch, decode

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["hello there", "the quick brown fox jumps over the lazy dog", "ferry", "a b c d e f g h i j k l m n"]
GREEDY = dict(temperature=0, max_tokens=10, extra_body={"ignore_eos": True})


def sync_client(system) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def async_client(system) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_sync_completions_and_chat_streaming_and_not(system):
    client = sync_client(system)
    whole = client.completions.create(model=system.model_name, prompt=PROMPTS[0], **GREEDY)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    stream = client.completions.create(model=system.model_name, prompt=PROMPTS[0], stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text

    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat = client.chat.completions.create(model=system.model_name, messages=messages, **GREEDY)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 10
    chunks = client.chat.completions.create(model=system.model_name, messages=messages, stream=True, **GREEDY)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content


async def test_async_completions_and_chat_streaming_and_not(system):
    client = async_client(system)
    whole = await client.completions.create(model=system.model_name, prompt=PROMPTS[2], **GREEDY)
    stream = await client.completions.create(model=system.model_name, prompt=PROMPTS[2], stream=True, **GREEDY)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == whole.choices[0].text
    messages = [{"role": "user", "content": PROMPTS[3]}]
    chat = await client.chat.completions.create(model=system.model_name, messages=messages, **GREEDY)
    chunks = await client.chat.completions.create(model=system.model_name, messages=messages, stream=True, **GREEDY)
    text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    assert text == chat.choices[0].message.content and chat.usage.completion_tokens == 10
    await client.close()


def test_greedy_output_through_the_system_equals_ferry_generate(system, tmp_path):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ferry.cli",
            "generate",
            "--model",
            str(system.model_dir),
            "--prompts-file",
            str(prompts_file),
            "--json",
            "--temperature",
            "0",
            "--max-tokens",
            "10",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    expected = [json.loads(line)["text"] for line in done.stdout.splitlines() if line.startswith("{")]
    client = sync_client(system)
    got = [client.completions.create(model=system.model_name, prompt=p, **GREEDY).choices[0].text for p in PROMPTS]
    assert got == expected


async def watch(nats_url: str, subject: str, msg_type, sink: list):
    from ferry.bus import connect

    async def collect(msg) -> None:
        sink.append(decode(msg.data, msg_type))

    nc = await connect(nats_url, "e2e-watch")
    await nc.subscribe(subject, cb=collect)
    return nc


async def test_every_worker_receives_work_under_load(system, nats_url):
    batches: list[OutputBatch] = []
    nc = await watch(nats_url, "ferry.out.>", OutputBatch, batches)
    client = async_client(system)
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(24)]
    results = await asyncio.gather(
        *(client.completions.create(model=system.model_name, prompt=p, **GREEDY) for p in prompts)
    )
    assert all(r.usage.completion_tokens == 10 for r in results)
    await nc.flush()
    await nc.close()
    await client.close()
    emitting = {b.worker_id for b in batches if b.tokens}
    # the launcher names workers <role>-<i>-<tag>: both prefill and both decode workers emitted tokens
    assert sorted(w.rsplit("-", 1)[0] for w in emitting) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]


async def test_cancelled_stream_frees_its_blocks_on_every_worker(system, nats_url):
    reports: list[LoadReport] = []
    num_workers = sum(1 for name in system.pids if name.startswith("worker-"))
    nc = await watch(nats_url, "ferry.load.>", LoadReport, reports)
    client = async_client(system)
    stream = await client.completions.create(
        model=system.model_name,
        prompt=PROMPTS[1],
        stream=True,
        temperature=0,
        max_tokens=1500,
        extra_body={"ignore_eos": True},
    )
    busy = []
    async for _ in stream:  # stream until a load report shows the request holding blocks
        busy = [r for r in reports if r.kv_blocks_used > 0 and r.num_running > 0]
        if busy:
            break
    await stream.close()  # the client disconnects mid-stream
    await asyncio.sleep(0.5)
    start = len(reports)
    for _ in range(100):
        await asyncio.sleep(0.1)
        latest = {r.worker_id: r for r in reports[start:]}
        if len(latest) >= num_workers and all(r.kv_blocks_used == 0 and r.num_running == 0 for r in latest.values()):
            break
    await nc.close()
    await client.close()
    assert busy, "no worker held KV blocks while the request streamed"
    assert len(latest) >= num_workers
    assert {w: (r.kv_blocks_used, r.num_running) for w, r in latest.items()} == {w: (0, 0) for w in latest}
