"""Overload: a burst of 10x the requests the system admits, against the whole system started by
`ferry up` (one process per service, loopback only, every wait bounded).

Admission is the gateway's `FERRY_MAX_INFLIGHT`: a request over it gets 429 + Retry-After at once,
before any bus or model work and before its prompt is tokenized. The prefill balancer's own
'overloaded' reply does not fire here: 4 admitted short prompts are far below its
`max_queued_tokens` (it counts each worker's engine queue, its JetStream backlog and what was routed
since its report). With every request first passing a gateway, the gateways' `max_inflight` (summed
over replicas) bounds the work in the system; the balancer's check is a second line for gateways
configured too wide.

Shown: rejected requests get 429 with Retry-After (never 500, never hang); every admitted request
completes; the gateway's and workers' resident memory stays bounded; the same requests take about
as long with the burst hammering the gateway as without it (side by side, generous factor).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from system_launch import RunningSystem, pid_alive, start_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ADMIT = 4
"""FERRY_MAX_INFLIGHT: requests the gateway admits at once."""
BURST = 10 * ADMIT
MAX_TOKENS = 600
"""Output tokens of the warm-up probes; the measured probes get as many as make them last about
PROBE_TARGET_S on this machine (the burst must last through them, whatever the machine's speed:
probes of ~0.9 s let the burst clients get only ~80 429s in, too few to prove anything)."""
PROBE_TARGET_S = 2.5
MAX_CONTEXT_TOKENS = 1900
"""Cap on the scaled max_tokens: the tiny model's context is 2048, the prompt a dozen tokens."""
RETRY_PAUSE_S = 0.25
"""Burst clients retry after this, a quarter of the Retry-After they get (1 s): 40 clients -> ~160
requests/s at the gateway. Hammering at 0.1 s (~400/s) measured 1.9x-3.1x on the shared 2-core box
(when a 429 still tokenized the prompt): each 429 costs the gateway a FastAPI body parse on the event
loop that also relays the admitted requests' tokens (admission in the ASGI layer would be cheaper)."""
REQUEST_TIMEOUT_S = 30.0
"""Bound on one HTTP request: a hang fails the test instead of blocking CI."""
RSS_BOUND_MIB = 16
"""Allowed growth of each service's VmRSS (peak, sampled every 50 ms) over its value right after the
same requests ran alone (warmed). Measured on the 2-core box (tiny model, 400 tokens, ~250-370 429s):
gateway +0.6..0.8 MiB (a 429 allocates a parsed body, a tokenized prompt and an error response, freed
at once), workers +0.1..0.2 MiB (they never see a rejected request). 16 MiB is 20x that, room for
allocator arenas and GC timing on a shared box. What bounds the work is admission itself (the 429s);
this bound catches a leak or a buffer that keeps rejected requests, which would grow with every one of
the hundreds of retries."""
WORKER_RSS_BOUND_MIB = 64
"""The workers never see a rejected request: their peak grows with the admitted ones only (8 under the
burst, against 4 in the warm run: KV copies of twice the sequences finishing together). Measured on the
2-core box on 2026-12-04: the decode worker +8.9 and +11.1 MiB at 5bf224d, +13.5 and +16.1 MiB (one CI
failure at the old 16) after that day's changes; the prefill worker +1.2..4.7. A leak per rejected request
would pass this by hundreds of MiB."""
LATENCY_FACTOR = 4.0
"""Admitted requests under the burst vs the same requests alone. Behavioural, not a benchmark: the
burst's 429s cost CPU (gateway and this test's own HTTP client) on a 2-core box shared with the workers
(measured 2.1x-2.6x with RETRY_PAUSE_S: the gateway spends ~3 ms CPU per 429 and the decode worker
has a core to itself only when nobody else runs); without admission the 40 extra requests would share
the decode batch with them (16 running, then the rest queued: several times longer)."""


@pytest.fixture(scope="module")
def overload_system(e2e_model, nats_url, redis_url, tmp_path_factory):
    env = {"FERRY_MAX_INFLIGHT": str(ADMIT), "FERRY_RETRY_AFTER_S": "1", "FERRY_REQUEST_TIMEOUT_S": "30"}
    running = start_system(
        e2e_model, nats_url, redis_url, tmp_path_factory.mktemp("overload"), prefill=1, decode=1, extra_env=env
    )
    yield running
    assert running.stop() == 0
    assert [n for n, pid in running.pids.items() if pid_alive(pid)] == []


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RssPeak:
    """Samples each pid's VmRSS every 50 ms in a thread; keeps the peak."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before: dict[str, float] = {}
        self.peak: dict[str, float] = {}
        self.mark()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def mark(self) -> None:
        """Now is 'before': peaks count from here."""
        self.before = {name: rss_mib(pid) for name, pid in self.pids.items()}
        self.cpu_before = {name: cpu_s(pid) for name, pid in self.pids.items()}
        self.peak = dict(self.before)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], rss_mib(pid))

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class Tally:
    admitted: int = 0
    completed: int = 0
    rejected: int = 0
    retry_after: set[str] = field(default_factory=set)
    bad: list[str] = field(default_factory=list)
    """Anything but 200-complete or 429 + Retry-After: 500s, other statuses, timeouts."""
    slowest_reject_s: float = 0.0
    reject_times: list[float] = field(default_factory=list)
    """time.monotonic() of each 429's arrival."""
    by_balancer: int = 0
    """429s from the prefill balancer's 'overloaded' (the rest are the gateway's FERRY_MAX_INFLIGHT)."""


def body(model: str, i: int, max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": f"probe {i}: the quick brown fox jumps over",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


async def one(client: httpx.AsyncClient, model: str, i: int, tally: Tally, max_tokens: int) -> bool:
    """One request; True when admitted (and then it must complete)."""
    started = time.monotonic()
    try:
        response = await client.post("/v1/completions", json=body(model, i, max_tokens))
    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
        tally.bad.append(repr(exc))
        return False
    if response.status_code == 429:
        tally.rejected += 1
        tally.reject_times.append(time.monotonic())
        tally.slowest_reject_s = max(tally.slowest_reject_s, time.monotonic() - started)
        tally.by_balancer += "requests in flight" not in response.text
        if "retry-after" in response.headers:
            tally.retry_after.add(response.headers["retry-after"])
        else:
            tally.bad.append("429 without Retry-After")
        return False
    tally.admitted += 1
    usage = response.json().get("usage", {}) if response.status_code == 200 else {}
    if usage.get("completion_tokens") == max_tokens:
        tally.completed += 1
    else:
        tally.bad.append(f"HTTP {response.status_code}: {response.text[:200]}")
    return True


async def timed_probes(client: httpx.AsyncClient, model: str, tally: Tally, max_tokens: int) -> list[float]:
    async def timed(i: int) -> float:
        started = time.monotonic()
        assert await one(client, model, i, tally, max_tokens), f"probe {i} was not admitted"
        return time.monotonic() - started

    return list(await asyncio.gather(*(timed(i) for i in range(ADMIT))))


async def burst_client(
    client: httpx.AsyncClient, model: str, i: int, tally: Tally, done: asyncio.Event, max_tokens: int
) -> None:
    """A client that retries until the probes are done, waiting a quarter of Retry-After (impatient:
    four times the retries well-behaved clients would send)."""
    while not done.is_set():
        if not await one(client, model, 1000 + i, tally, max_tokens):
            await asyncio.sleep(RETRY_PAUSE_S)


@dataclass
class Window:
    """When the burst clients started and when the probes under the burst were all answered."""

    burst_started: float
    probes_done: float


async def unloaded_and_burst(
    system: RunningSystem, rss: RssPeak
) -> tuple[list[float], list[float], Tally, Tally, Window]:
    alone, loaded = Tally(), Tally()
    limits = httpx.Limits(max_connections=BURST + ADMIT + 4)
    async with httpx.AsyncClient(base_url=system.base_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        # warm-up: first-request costs out of the way, and this machine's speed for the probes' length
        warm_s = max(await timed_probes(client, system.model_name, Tally(), MAX_TOKENS))
        max_tokens = min(MAX_CONTEXT_TOKENS, max(MAX_TOKENS, round(MAX_TOKENS * PROBE_TARGET_S / warm_s)))
        unloaded = await timed_probes(client, system.model_name, alone, max_tokens)
        rss.mark()  # warmed, and just served the admitted load: the pre-burst value
        done = asyncio.Event()
        probes = asyncio.create_task(timed_probes(client, system.model_name, loaded, max_tokens))
        await asyncio.sleep(0.2)  # the probes are admitted first (admission is on arrival, no model work)
        burst_started = time.monotonic()
        burst = [
            asyncio.create_task(burst_client(client, system.model_name, i, loaded, done, max_tokens))
            for i in range(BURST)
        ]
        under_burst = await asyncio.wait_for(probes, REQUEST_TIMEOUT_S)
        window = Window(burst_started, time.monotonic())
        done.set()
        await asyncio.wait_for(asyncio.gather(*burst), REQUEST_TIMEOUT_S + 5)
    return unloaded, under_burst, alone, loaded, window


def test_burst_of_10x_gets_429_and_admitted_requests_keep_latency(overload_system):
    services = {n: p for n, p in overload_system.pids.items() if n == "gateway" or n.startswith("worker-")}
    assert {"gateway", "worker-prefill-0", "worker-decode-0"} <= set(services), overload_system.pids
    with RssPeak(services) as rss:
        started = time.monotonic()
        unloaded, under_burst, alone, loaded, window = asyncio.run(unloaded_and_burst(overload_system, rss))
        elapsed = time.monotonic() - started
    before = {name: round(mib, 1) for name, mib in rss.before.items()}
    growth = {name: round(rss.peak[name] - rss.before[name], 1) for name in services}
    cpu = {name: round(cpu_s(pid) - rss.cpu_before[name], 2) for name, pid in services.items()}
    print(
        f"\noverload: admit {ADMIT}, burst {BURST} clients, {elapsed:.1f}s; latency alone "
        f"{[round(t, 2) for t in unloaded]} s, under burst {[round(t, 2) for t in under_burst]} s; "
        f"429s {loaded.rejected} ({loaded.by_balancer} by the balancer, slowest {loaded.slowest_reject_s:.3f}s, "
        f"{sum(window.burst_started <= t <= window.probes_done for t in loaded.reject_times)} while the probes "
        f"ran for {window.probes_done - window.burst_started:.2f}s), "
        f"admitted {loaded.admitted}, CPU s during the burst {cpu}, "
        f"completed {loaded.completed}; RSS before {before} MiB, peak growth {growth} MiB"
    )
    assert alone.bad == [] and loaded.bad == [], (alone.bad, loaded.bad)
    # the burst lasted through the probes (else it proved nothing): every client was turned away
    # more than once while they ran, and 429s kept coming until the last probe was answered. The
    # probes last ~1.6-2.5 s under the burst (their length is capped by the tiny model's context), and
    # the first wave of 40 at once takes up to ~1.3 s to be rejected: measured 116 429s in 1.6 s on
    # the CI box, 250-370 with longer probes.
    during = [t for t in loaded.reject_times if window.burst_started <= t <= window.probes_done]
    assert len(during) >= 2 * BURST, f"only {len(during)} 429s while the probes ran: proved nothing"
    assert window.probes_done - max(during) < 0.5, "the burst stopped before the probes were answered"
    assert loaded.retry_after == {"1"}, loaded.retry_after
    # a 429 comes at once (measured 0.1-2.5 s on the shared box: the initial wave of 40 at once), not
    # after queueing behind the admitted requests (~1-2 s each, and 10 of them would be ~10 s)
    assert loaded.slowest_reject_s < REQUEST_TIMEOUT_S / 3, "a 429 must come at once, not after queueing"
    assert loaded.completed == loaded.admitted >= ADMIT
    assert all(g < (RSS_BOUND_MIB if name == "gateway" else WORKER_RSS_BOUND_MIB) for name, g in growth.items()), growth
    assert max(under_burst) <= LATENCY_FACTOR * max(unloaded), (unloaded, under_burst)
