"""Fault injection: the whole system, one process per service (as `ferry up` plans them), with a
worker SIGKILLed while greedy streams run through it. Every request must still complete, with no
duplicated or missing token: its text equals the fault-free run's (the gateway migrates it).

Prints a table (fault x sent x completed x lost x duplicated tokens x wrong text x migrated).
Loopback only; every wait is bounded. Own nats-server and redis-server, so a fault can restart them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgpack
import nats
import nats.errors
import pytest
from system_launch import plan_up

from ferry.launcher.servers import free_port, start_nats, start_redis
from ferry.launcher.up import Child, spawn, stop_children, wait_ready
from ferry.protocol import ErrorReply, LoadReport, decode, subjects

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 160
PROMPTS = [f"request {i}: " + " ".join(["the quick brown fox"] * (2 + i % 3)) for i in range(6)]
STREAM_TIMEOUT_S = 90.0
"""Bound on one streamed request: a hang fails the test instead of blocking CI."""
ENV = {
    "FERRY_LOAD_INTERVAL_S": "0.25",
    "FERRY_REQUEST_TIMEOUT_S": "60",
    "FERRY_MAX_ATTEMPTS": "3",
    "FERRY_LOG_LEVEL": "INFO",
    "FERRY_STREAM_INTERVAL_MS": "0",
}
"""FERRY_STREAM_INTERVAL_MS 0: the faults are timed by SSE chunks, one per token here. With `ferry up`'s
small-machine default (20 ms bunches) the tiny model's 160 tokens come in ~10 chunks within ~0.25 s, and
a fault meant for mid-stream lands after the end. Bunched streams are covered elsewhere
(tests/integration/test_worker_pipeline.py, the other e2e tests run `ferry up` with its defaults)."""


@dataclass
class FaultSystem:
    children: dict[str, Child]
    base_url: str
    model_name: str
    run_dir: Path
    servers: list = field(default_factory=list)
    """[redis, nats] handles (stopped in reverse order)."""
    restarts: list[threading.Thread] = field(default_factory=list)
    killed: set[str] = field(default_factory=set)
    """Services SIGKILLed on purpose and not started again."""

    def kill(self, name: str) -> None:
        """SIGKILL one service: no drain, no goodbye, its JetStream messages stay unacked."""
        child = self.children[name]
        child.process.kill()
        child.process.wait(timeout=10)
        self.killed.add(name)

    def respawn(self, name: str) -> None:
        """Start a killed service again under the same name (and worker id)."""
        child = self.children[name]
        self.children[name] = spawn(child.spec, self.run_dir)
        self.killed.discard(name)

    async def busiest(self, role: str) -> str:
        """The service name of the `role` worker running the most sequences, from one round of
        their load reports (so a kill is sure to hit requests, wherever the balancer put them)."""
        names = {
            c.spec.worker_id: name
            for name, c in self.children.items()
            if c.spec.worker_id and c.spec.env.get("FERRY_ROLE") == role and name not in self.killed
        }
        running: dict[str, int] = {}
        nc = await nats.connect(self.servers[1].url)
        try:

            async def on_report(msg) -> None:
                report = decode(msg.data, LoadReport)
                running[report.worker_id] = report.num_running

            await nc.subscribe(subjects.load_role(role), cb=on_report)
            deadline = time.monotonic() + 10 * float(ENV["FERRY_LOAD_INTERVAL_S"])
            while time.monotonic() < deadline and not set(names) <= set(running):
                await asyncio.sleep(0.01)
        finally:
            await nc.close()
        return names[max(names, key=lambda w: running.get(w, -1))]

    def restart_server(self, index: int, down_s: float) -> None:
        """Stop nats-server or redis-server, and start it again on the same port after `down_s`
        (in a thread: the test's streams keep running meanwhile). NATS keeps its JetStream store."""
        old = self.servers[index]
        old.stop()

        def start_again() -> None:
            time.sleep(down_s)
            if old.name == "nats-server":
                self.servers[index] = start_nats(port=old.port, store_dir=old.workdir)
            else:
                self.servers[index] = start_redis(port=old.port)

        thread = threading.Thread(target=start_again, daemon=True)
        thread.start()
        self.restarts.append(thread)

    def log(self, name: str) -> str:
        return self.children[name].log_path.read_text(errors="replace")

    def stop(self) -> None:
        for thread in self.restarts:
            thread.join(timeout=30)
        stop_children(list(self.children.values()))
        for server in reversed(self.servers):
            server.stop()


def launch(model_dir: Path, run_dir: Path, env: dict[str, str]) -> FaultSystem:
    """2 prefill + 2 decode workers, both balancers, kvcache and the gateway, one process each (as
    `ferry up` plans them, with `env` added), on their own nats-server and redis-server."""
    nats = start_nats(store_dir=run_dir / "nats")
    redis = start_redis()
    port = free_port()
    argv = ["--model", str(model_dir), "--prefill-workers", "2", "--decode-workers", "2", "--port", str(port)]
    try:
        specs = plan_up(argv + ["--num-kv-blocks", "512", "--max-running", "16"], model_dir, nats.url, redis.url)
    except Exception:
        redis.stop()
        nats.stop()
        raise
    children = {}
    for spec in specs:
        spec.env.update(env)
        children[spec.name] = spawn(spec, run_dir)
    system = FaultSystem(children, f"http://127.0.0.1:{port}", model_dir.name, run_dir, [redis, nats])
    problem = wait_ready(list(children.values()), system.base_url, 240)
    if problem:
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(run_dir.glob("*.log")))
        system.stop()
        raise RuntimeError(f"system not ready: {problem}{logs}")
    return system


@pytest.fixture(scope="module")
def fault_system(e2e_model, tmp_path_factory) -> FaultSystem:
    system = launch(e2e_model, tmp_path_factory.mktemp("faults"), ENV)
    yield system
    system.stop()


@dataclass
class Outcome:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""
    num_chunks: int = 0
    arrivals: list[float] = field(default_factory=list)
    """time.monotonic() of every chunk with text."""


async def stream_one(
    client: httpx.AsyncClient, model: str, prompt: str, outcome: Outcome, max_tokens: int = MAX_TOKENS
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome.error = str(chunk["error"])
                    return
                if chunk.get("usage"):
                    outcome.num_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    outcome.text += choice.get("text", "")
                    outcome.num_chunks += 1
                    outcome.arrivals.append(time.monotonic())
                    outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
        outcome.error = repr(exc)


async def run_load(
    system: FaultSystem, fault=None, when_chunks: int = 0, max_tokens: int = MAX_TOKENS
) -> list[Outcome]:
    """Stream every prompt at once; when each has `when_chunks` chunks (or at once), call `fault`."""
    outcomes = [Outcome() for _ in PROMPTS]
    async with httpx.AsyncClient(base_url=system.base_url, timeout=STREAM_TIMEOUT_S) as client:
        tasks = [
            asyncio.create_task(stream_one(client, system.model_name, p, o, max_tokens))
            for p, o in zip(PROMPTS, outcomes)
        ]
        if fault is not None:
            deadline = time.monotonic() + 30
            while min(o.num_chunks for o in outcomes) < when_chunks and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            done = fault()
            if asyncio.iscoroutine(done):
                await done
        await asyncio.wait_for(asyncio.gather(*tasks), STREAM_TIMEOUT_S + 10)
    return outcomes


@dataclass
class Row:
    fault: str
    sent: int
    completed: int
    lost: int
    duplicated_tokens: int
    wrong_text: int
    migrated: int

    def line(self) -> str:
        return (
            f"{self.fault:<34} {self.sent:>5} {self.completed:>9} {self.lost:>5} {self.duplicated_tokens:>11}"
            f" {self.wrong_text:>6} {self.migrated:>8}"
        )


HEADER = f"{'fault':<34} {'sent':>5} {'completed':>9} {'lost':>5} {'dup tokens':>11} {'wrong':>6} {'migrated':>8}"


def score(fault: str, outcomes: list[Outcome], baseline: list[Outcome], migrated: int) -> Row:
    done = [o for o in outcomes if not o.error and o.finish_reason == "length"]
    duplicated = sum(max(0, o.num_tokens - b.num_tokens) for o, b in zip(outcomes, baseline))
    wrong = sum(1 for o, b in zip(outcomes, baseline) if not o.error and o.text != b.text)
    return Row(fault, len(outcomes), len(done), len(outcomes) - len(done), duplicated, wrong, migrated)


@pytest.fixture(scope="module")
def table(request):
    rows: list[Row] = []
    yield rows
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown even without -s
        print("\n".join(["", "fault-injection table", HEADER, *(r.line() for r in rows)]), flush=True)


@pytest.fixture(scope="module")
def baseline(fault_system) -> list[Outcome]:
    outcomes = asyncio.run(run_load(fault_system))
    assert all(not o.error and o.num_tokens == MAX_TOKENS for o in outcomes), outcomes
    return outcomes


def migrations(system: FaultSystem) -> int:
    return system.log("gateway").count("migrating ")


def recomputes(system: FaultSystem) -> int:
    """Hand-offs whose KV a decode worker had to recompute (the store lost it or was down)."""
    return sum(system.log(name).count("recomputing it") for name in system.children if name.startswith("worker-decode"))


def check(system: FaultSystem, table: list[Row], fault: str, outcomes: list[Outcome], baseline, before: int) -> Row:
    row = score(fault, outcomes, baseline, migrations(system) - before)
    table.append(row)
    errors = [o.error for o in outcomes if o.error]
    assert row.lost == 0 and row.duplicated_tokens == 0 and row.wrong_text == 0, (row, errors)
    return row


def test_sigkill_decode_worker_mid_stream(fault_system, table):
    """Streams 4x the usual length (and their own fault-free run): at 160 tokens a fast decode could end
    every stream between the 10th token and the kill (finding the busiest worker takes a load report)."""
    long_tokens = 4 * MAX_TOKENS
    baseline = asyncio.run(run_load(fault_system, max_tokens=long_tokens))
    assert all(not o.error and o.num_tokens == long_tokens for o in baseline), baseline
    before = migrations(fault_system)

    async def kill_busiest_decode_worker() -> None:
        fault_system.kill(await fault_system.busiest("decode"))

    outcomes = asyncio.run(run_load(fault_system, kill_busiest_decode_worker, 10, long_tokens))
    row = check(fault_system, table, "SIGKILL decode worker mid-stream", outcomes, baseline, before)
    assert row.migrated >= 1, "the kill hit no request: the test proved nothing"


def rerouted(system: FaultSystem) -> int:
    """Queued messages of a silent worker that a balancer moved to a live one."""
    return sum(system.log(name).count("re-routed ") for name in ("prefill-balancer", "decode-balancer"))


def test_sigkill_prefill_worker(fault_system, baseline, table):
    """Killed as the requests go out: those routed to it (the balancer has not noticed yet) are saved
    either by the gateway (migration) or by the balancer moving its queue, whichever acts first."""
    before, moved = migrations(fault_system), rerouted(fault_system)
    outcomes = asyncio.run(run_load(fault_system, lambda: fault_system.kill("worker-prefill-0"), when_chunks=0))
    row = check(fault_system, table, "SIGKILL prefill worker", outcomes, baseline, before)
    assert row.migrated + rerouted(fault_system) - moved >= 1, "no request met the dead worker: proved nothing"


def test_redis_restart_falls_back_to_recompute(fault_system, baseline, table):
    """The KV store vanishes (restart without persistence = flush) while sequences are handed off:
    prefill workers fail to store, decode workers miss and recompute; nobody notices."""
    before, recomputed = migrations(fault_system), recomputes(fault_system)
    outcomes = asyncio.run(run_load(fault_system, lambda: fault_system.restart_server(0, down_s=1.0)))
    check(fault_system, table, "Redis restart (KV lost)", outcomes, baseline, before)
    assert recomputes(fault_system) > recomputed, "no hand-off met the outage: the test proved nothing"
    fault_system.restarts[-1].join(timeout=30)


def test_balancer_restart_rebuilds_from_load_reports(fault_system, baseline, table):
    def restart_balancers() -> None:
        for name in ("prefill-balancer", "decode-balancer"):
            fault_system.kill(name)
            fault_system.respawn(name)

    before = migrations(fault_system)
    outcomes = asyncio.run(run_load(fault_system, restart_balancers, when_chunks=1))
    check(fault_system, table, "balancers SIGKILLed + restarted", outcomes, baseline, before)
    # and they route new work again once they have heard the workers' next reports
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
        fault_system.log(name).count(" started (id ") >= 2 for name in ("prefill-balancer", "decode-balancer")
    ):
        time.sleep(0.1)
    time.sleep(4 * float(ENV["FERRY_LOAD_INTERVAL_S"]))
    outcomes = asyncio.run(run_load(fault_system))
    check(fault_system, table, "after balancer restart", outcomes, baseline, before)


def test_nats_restart_reconnects_everything(fault_system, baseline, table):
    """In-flight requests complete or fail with a clear 503 within the bound (none hang); once
    NATS is back, every service has reconnected and new requests complete."""
    before = migrations(fault_system)
    outcomes = asyncio.run(run_load(fault_system, lambda: fault_system.restart_server(1, down_s=1.0), when_chunks=5))
    row = score("NATS restart (in flight)", outcomes, baseline, migrations(fault_system) - before)
    table.append(row)
    for o in outcomes:  # bounded by STREAM_TIMEOUT_S in run_load; failures must say why
        assert o.error == "" or "503" in o.error or "worker_lost" in o.error or "bus_unavailable" in o.error, o.error
    fault_system.restarts[-1].join(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and httpx.get(f"{fault_system.base_url}/ready").status_code != 200:
        time.sleep(0.2)
    before = migrations(fault_system)
    outcomes = asyncio.run(run_load(fault_system))
    check(fault_system, table, "after NATS restart", outcomes, baseline, before)


def nested(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


def garbage_payloads(gateway_id: str) -> list[bytes]:
    sampling = {"max_tokens": 2**40, "temperature": 0.0}
    hostile_request = {
        "request_id": "hostile-1",
        "gateway_id": gateway_id,
        "model": "nope",
        "prompt_token_ids": [10**9, -5],
        "sampling": sampling,
    }
    return [
        b"",
        b"\x00",
        b"\xc1" * 64,
        b"not msgpack at all",
        bytes(range(256)) * 8,
        msgpack.packb([1, "submit", {"request": "x"}]),  # wrong field type
        msgpack.packb([1, "submit", {"request": hostile_request}]),  # well-formed, absurd values
        msgpack.packb(
            [
                1,
                "handoff",
                {
                    "request": hostile_request,
                    "prefill_worker_id": "p",
                    "kv_namespace": "x",
                    "kv_blocks": [],
                    "num_kv_tokens": 0,
                },
            ]
        ),
        msgpack.packb(
            [1, "output", {"worker_id": "w", "tokens": [{"request_id": "zz", "index": -1, "token_ids": ["a"]}]}]
        ),
        msgpack.packb([1, "load", {"worker_id": "bad worker!", "role": "prefill"}]),
        msgpack.packb([99, "cancel", {}]),
        msgpack.packb([1, "no_such_type", {}]),
        msgpack.packb([1, "cancel", {"request_ids": list(range(100_000))}]),
        msgpack.packb(nested(60)),
        msgpack.packb([1, "prefill_work", {"request": hostile_request}]),
        b"\x91" * 100_000,  # 100k nested arrays
        msgpack.packb([1, "submit", {"request": {**hostile_request, "prompt_token_ids": [1] * 900_000}}]),
    ]


def test_garbage_on_every_subject_harms_nobody(fault_system, baseline, table):
    """Garbage, wrong-typed and absurd messages on every subject any service listens to, while
    requests run: requests still complete exactly, request/reply endpoints answer an error, and
    every service process is still alive afterwards."""
    gateway_id = fault_system.children["gateway"].spec.env["FERRY_GATEWAY_ID"]
    workers = [c.spec for c in fault_system.children.values() if c.spec.worker_id]
    subjects_all = [
        subjects.SUBMIT,
        subjects.HANDOFF,
        subjects.CANCEL,
        subjects.KV_LOOKUP,
        subjects.KV_STATS,
        subjects.KV_EVENTS,
        subjects.out(gateway_id),
        "ferry.load.prefill.x",
        "ferry.load.decode.x",
        *(subjects.load(w.env["FERRY_ROLE"], w.worker_id) for w in workers),
    ]
    work_subjects = [subjects.work(w.env["FERRY_ROLE"], w.worker_id) for w in workers]
    replies: list[bytes] = []

    async def send_garbage() -> None:
        nc = await nats.connect(fault_system.servers[1].url)
        js = nc.jetstream()
        for payload in garbage_payloads(gateway_id):
            for subject in subjects_all:
                if subject in (subjects.SUBMIT, subjects.HANDOFF, subjects.KV_LOOKUP, subjects.KV_STATS):
                    with contextlib.suppress(nats.errors.TimeoutError, nats.errors.NoRespondersError):
                        replies.append((await nc.request(subject, payload, timeout=5)).data)
                else:
                    await nc.publish(subject, payload)
            for subject in work_subjects:  # durable work queues: a bad message must be dropped, not retried forever
                with contextlib.suppress(Exception):
                    await js.publish(subject, payload)
        await nc.flush()
        await nc.close()

    before = migrations(fault_system)
    outcomes = asyncio.run(run_load(fault_system, send_garbage, when_chunks=3))
    check(fault_system, table, "garbage on every NATS subject", outcomes, baseline, before)
    assert replies, "no request/reply endpoint answered"
    for data in replies:  # each a typed answer; a refusal names the problem, never an internal error
        reply = decode(data)
        assert not isinstance(reply, ErrorReply) or reply.code != "internal", reply
    time.sleep(1.0)  # let the last messages be handled
    dead = {name: c.process.returncode for name, c in fault_system.children.items() if c.process.poll() is not None}
    unexpected = {n: (code, fault_system.log(n)[-2000:]) for n, code in dead.items() if n not in fault_system.killed}
    assert not unexpected, unexpected
    outcomes = asyncio.run(run_load(fault_system))
    check(fault_system, table, "after the garbage", outcomes, baseline, before)
