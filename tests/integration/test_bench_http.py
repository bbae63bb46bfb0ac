"""The bench's HTTP client against a real loopback server: a small OpenAI-compatible SSE peer
written here (FastAPI + uvicorn), whose timing and token counts the client must recover.

The peer streams `max_tokens` chunks per request, the first after `ttft_s` and the rest `itl_s`
apart, records every body and the most requests it had in flight, and serves that in-flight count
as the Prometheus gauge `ferry_requests_running{role="decode"}`. `hf_strict` mimics
`transformers serve`: unknown body fields get a 422 and usage always comes in the last chunk.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ferry.bench.http_client import CompletionCall
from ferry.bench.online import OnlineConfig, run_phase

pytestmark = pytest.mark.integration

HF_FIELDS = {"model", "prompt", "max_tokens", "temperature", "stream", "generation_config", "seed"}


@dataclass
class Peer:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    send_usage: bool = True
    hf_strict: bool = False
    silent: bool = False
    cut: bool = False
    """End the stream right after the content chunks (a server that died mid-answer)."""
    """Generate but stream no text (a server skipping special tokens): only the usage chunk."""
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def _app(peer: Peer) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if peer.hf_strict and set(body) - HF_FIELDS:
            return JSONResponse({"detail": f"Unexpected fields in the request: {set(body) - HF_FIELDS}"}, 422)
        peer.bodies.append(body)
        return StreamingResponse(_stream(peer, body), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# TYPE ferry_requests_running gauge\n"
            f'ferry_requests_running{{role="decode"}} {peer.in_flight}\n'
            'ferry_requests_running{role="prefill"} 100\n'
        )

    return app


async def _stream(peer: Peer, body: dict):
    num = int(body["max_tokens"])
    if body.get("generation_config"):
        num = int(json.loads(body["generation_config"])["min_new_tokens"])
    peer.in_flight += 1
    peer.max_in_flight = max(peer.max_in_flight, peer.in_flight)
    try:
        await asyncio.sleep(peer.ttft_s)
        for i in range(num):
            if i:
                await asyncio.sleep(peer.itl_s)
            if not peer.silent:
                yield _sse({"choices": [{"index": 0, "text": f"tok{i} ", "finish_reason": None}]})
        if peer.cut:
            return
        yield _sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if peer.hf_strict or (peer.send_usage and body.get("stream_options", {}).get("include_usage")):
            yield _sse({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": num}})
        yield "data: [DONE]\n\n"
    finally:
        peer.in_flight -= 1


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@pytest.fixture
async def served():
    """(base_url, peer) of a fresh peer on a free loopback port, served in this event loop."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    peer = Peer()
    server = uvicorn.Server(
        uvicorn.Config(_app(peer), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "stub server did not start"
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}", peer
    server.should_exit = True
    await task


def _calls(lengths: list[int]) -> list[CompletionCall]:
    return [
        CompletionCall(index=i, prompt=list(range(5 + i)), max_tokens=n, num_prompt_tokens=5 + i)
        for i, n in enumerate(lengths)
    ]


def _config(base_url: str, **kw) -> OnlineConfig:
    return OnlineConfig(base_url=base_url, model="stub", show_progress=False, **kw)


async def test_counts_requests_and_tokens_and_times_from_arrivals(served):
    base_url, peer = served
    peer.ttft_s, peer.itl_s = 0.08, 0.02
    lengths = [4, 8, 16, 4, 8, 16, 4, 8]
    phase = await run_phase(_calls(lengths), [0.0] * 8, _config(base_url), "offline", math.inf)
    assert len(peer.bodies) == 8 and all(r.ok for r in phase.results)
    assert [r.num_output_tokens for r in phase.results] == lengths
    assert [r.num_prompt_tokens for r in phase.results] == [5 + i for i in range(8)]
    assert all(b["ignore_eos"] and b["min_tokens"] == b["max_tokens"] for b in peer.bodies)
    for r, n in zip(phase.results, lengths):
        # Times are arrival times: nothing can come before the peer sent it. (Single gaps may be ~0
        # when the client reads two chunks at once, so bounds are on first, last and the sum.)
        assert r.ttft_s >= peer.ttft_s
        assert r.chunk_times_s[-1] >= peer.ttft_s + (n - 1) * peer.itl_s * 0.95
        assert len(r.chunk_times_s) == n and sum(r.itl_s) == pytest.approx(r.chunk_times_s[-1] - r.ttft_s)
        assert r.tpot_s == pytest.approx((r.chunk_times_s[-1] - r.ttft_s) / (n - 1))
        assert r.e2e_s >= r.chunk_times_s[-1]


async def test_counts_tokens_from_chunks_without_usage(served):
    base_url, peer = served
    peer.send_usage, peer.ttft_s, peer.itl_s = False, 0.0, 0.0
    phase = await run_phase(_calls([3, 7]), [0.0, 0.0], _config(base_url), "p", math.inf)
    assert [r.num_output_tokens for r in phase.results] == [3, 7]


async def test_silent_stream_with_usage_counts_tokens_but_has_no_ttft(served):
    base_url, peer = served
    peer.silent, peer.ttft_s, peer.itl_s = True, 0.0, 0.0
    phase = await run_phase(_calls([5]), [0.0], _config(base_url), "p", math.inf)
    (r,) = phase.results
    assert r.ok and r.num_output_tokens == 5 and r.ttft_s is None and r.tpot_s is None
    peer.send_usage = False  # nothing streamed and no usage: a failed request
    phase = await run_phase(_calls([5]), [0.0], _config(base_url), "p", math.inf)
    assert not phase.results[0].ok and phase.results[0].error == "stream ended without any token"


async def test_stream_cut_before_finish_is_an_error(served):
    base_url, peer = served
    peer.cut, peer.ttft_s, peer.itl_s = True, 0.0, 0.0
    phase = await run_phase(_calls([4]), [0.0], _config(base_url), "p", math.inf)
    (r,) = phase.results
    assert not r.ok and r.error == "stream cut after 4 tokens (no finish_reason)"


async def test_concurrency_is_bounded(served):
    base_url, peer = served
    peer.ttft_s, peer.itl_s = 0.05, 0.005
    phase = await run_phase(_calls([8] * 10), [0.0] * 10, _config(base_url, max_concurrency=3), "p", math.inf)
    assert all(r.ok for r in phase.results)
    assert peer.max_in_flight == 3


async def test_poisson_schedule_is_followed(served):
    base_url, peer = served
    peer.ttft_s, peer.itl_s = 0.0, 0.0
    arrivals = [0.0, 0.15, 0.3, 0.45]
    phase = await run_phase(_calls([2] * 4), arrivals, _config(base_url), "poisson", 6.0)
    sent = [r.sent_at_s for r in phase.results]
    assert all(s >= a for s, a in zip(sent, arrivals))  # never early
    assert all(s - a < 0.1 for s, a in zip(sent, arrivals))
    assert phase.scheduled_s == arrivals and phase.rate_rps == 6.0


async def test_time_limit_cancels_and_reports_unfinished_requests(served):
    base_url, peer = served
    peer.ttft_s, peer.itl_s = 0.0, 0.2
    phase = await run_phase(_calls([2, 50]), [0.0, 0.0], _config(base_url, phase_time_limit_s=1.0), "p", math.inf)
    assert phase.timed_out
    assert phase.results[0].ok
    assert not phase.results[1].ok and "time limit" in phase.results[1].error
    assert phase.duration_s < 2.0


async def test_hf_server_gets_generation_config_not_extra_fields(served):
    base_url, peer = served
    peer.hf_strict, peer.ttft_s, peer.itl_s = True, 0.0, 0.0
    rejected = await run_phase(_calls([3]), [0.0], _config(base_url), "extra", math.inf)
    assert not rejected.results[0].ok and rejected.results[0].error.startswith("HTTP 422")
    accepted = await run_phase(
        _calls([3]), [0.0], _config(base_url, length_control="hf-generation-config"), "hf", math.inf
    )
    assert accepted.results[0].ok and accepted.results[0].num_output_tokens == 3


async def test_batch_size_is_sampled_from_metrics(served):
    base_url, peer = served
    peer.ttft_s, peer.itl_s = 0.05, 0.02
    config = _config(base_url, metrics_urls=(f"{base_url}/metrics",), metrics_interval_s=0.05)
    phase = await run_phase(_calls([20] * 4), [0.0] * 4, config, "p", math.inf)
    values = [v for _, v in phase.batch_samples]
    assert values and max(values) == 4.0  # the prefill gauge (100) is filtered out
    assert all(0 <= v <= 4 for v in values)


async def test_connection_refused_is_an_error_not_a_crash():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    phase = await run_phase(_calls([2]), [0.0], _config(f"http://127.0.0.1:{port}"), "p", math.inf)
    assert not phase.results[0].ok and "ConnectError" in phase.results[0].error


async def test_ferry_bench_url_writes_json_png_and_markdown(served, tmp_path):
    from ferry.bench.workload import WorkloadConfig, make_workload
    from ferry.cli import main

    base_url, peer = served
    peer.ttft_s, peer.itl_s = 0.01, 0.002
    argv = [
        "bench",
        "--url",
        base_url,
        "--num-requests",
        "6",
        "--seed",
        "3",
        "--output-lens",
        "4,8",
        "--rates",
        "inf,30",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--metrics-url",
        f"{base_url}/metrics",
    ]
    assert await asyncio.to_thread(main, argv) == 0  # the CLI runs its own event loop; the peer runs in ours
    workload = make_workload(WorkloadConfig(num_requests=6, seed=3, output_lens=(4, 8)))
    assert len(peer.bodies) == 12  # two phases of six
    assert sorted(map(len, (b["prompt"] for b in peer.bodies))) == sorted(
        [len(r.prompt_token_ids) for r in workload] * 2
    )
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [s["name"] for s in report["summary"]] == ["all-at-once", "poisson-30rps"]
    for s in report["summary"]:
        assert s["num_ok"] == 6 and s["output_tokens"] == sum(r.max_tokens for r in workload)
        assert s["ttft_ms"]["p50"] >= 10.0
    assert report["meta"]["model"] == "stub-model"  # detected from /v1/models
    for name in ("throughput_vs_load.png", "ttft_cdf.png", "itl_cdf.png", "batch_size.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert "| poisson-30rps | 30.00 | 6/6 |" in (tmp_path / "summary.md").read_text()
