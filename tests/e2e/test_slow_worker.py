"""A slow worker does not stall the others: the whole system (`ferry up`, one process per service,
2 decode workers), greedy streams running through both decode workers, then one decode worker is
SIGSTOPped for a few seconds (frozen: no tokens, no load reports, its sockets stay open) and
SIGCONTed. Shown: the streams on the other worker keep their small inter-token gaps while it is
frozen; the frozen worker's streams complete with the same text as a fault-free run (no lost or
duplicated token): after a long freeze the gateway has migrated them (its load reports stopped, see
docs/internals.md "Migration"), after a short one they resume on the same worker once SIGCONTed.

Loopback only; every wait bounded. Prints a row in test_faults.py's table format.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from system_launch import RunningSystem, pid_alive, start_system
from test_faults import HEADER, Outcome, Row, stream_one

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 900
"""Long enough that the streams outlast the freeze (the tiny model streams a token in ~1-2 ms here);
4 x (prompt + 900) tokens still fit one worker's 256 x 16 KV slots, so the survivor can take the frozen
worker's streams."""
PROMPTS = [f"stream {i}: " + " ".join(["over the lazy dog"] * (2 + i % 3)) for i in range(4)]
REPORT_INTERVAL_S = 0.25
"""FERRY_LOAD_INTERVAL_S: the gateway calls a holder lost after 3 of them silent."""
LONG_STOP_S = 2.5
"""> 3 report intervals: the gateway migrates the frozen worker's streams."""
SHORT_STOP_S = 0.4
"""< 3 report intervals minus one (the last report may be up to one interval old): no migration;
the frozen worker's streams go on where they were after SIGCONT."""
GAP_BOUND_S = 0.5
"""Largest inter-token gap allowed to a stream on the live worker during the long freeze. Measured:
its gaps during the freeze 0.02-0.04 s, the fault-free run's largest 0.07-0.21 s (while the 4 prompts
prefill; the box is shared); a stalled stream would wait the whole 2.5 s, the frozen worker's wait
~1.05 s until migrated. (The short freeze is too short for a gap bound: there the live streams must
just keep producing tokens.)"""
STREAM_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def two_decode(e2e_model, nats_url, redis_url, tmp_path_factory):
    env = {"FERRY_REQUEST_TIMEOUT_S": "60", "FERRY_MAX_ATTEMPTS": "3", "FERRY_LOAD_INTERVAL_S": str(REPORT_INTERVAL_S)}
    env["FERRY_STREAM_INTERVAL_MS"] = "0"  # the freeze is timed by chunks, one per token (test_faults.py says why)
    run_dir = tmp_path_factory.mktemp("slow")
    running = start_system(e2e_model, nats_url, redis_url, run_dir, prefill=1, decode=2, extra_env=env)
    yield running, run_dir
    for pid in running.pids.values():  # never leave a worker frozen, whatever failed
        if pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
    assert running.stop() == 0
    assert [n for n, pid in running.pids.items() if pid_alive(pid)] == []


class Stream(Outcome):
    def gaps_within(self, start: float, end: float) -> list[float]:
        times = [t for t in self.arrivals if start <= t <= end]
        return [b - a for a, b in zip(times, times[1:])]


async def run_streams(
    system: RunningSystem, freeze_pid: int | None = None, stop_s: float = 0.0
) -> tuple[list[Stream], float, float]:
    """All prompts at once; with `freeze_pid`, SIGSTOP it once every stream has 20 chunks and
    SIGCONT it `stop_s` later. Returns the streams and the freeze's (start, end)."""
    streams = [Stream() for _ in PROMPTS]
    stopped_at = resumed_at = 0.0
    async with httpx.AsyncClient(base_url=system.base_url, timeout=STREAM_TIMEOUT_S) as client:
        tasks = [
            asyncio.create_task(stream_one(client, system.model_name, p, s, MAX_TOKENS))
            for p, s in zip(PROMPTS, streams)
        ]
        if freeze_pid is not None:
            deadline = time.monotonic() + 30
            while min(s.num_chunks for s in streams) < 20 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            os.kill(freeze_pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                await asyncio.sleep(stop_s)
            finally:
                os.kill(freeze_pid, signal.SIGCONT)
                resumed_at = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), STREAM_TIMEOUT_S + 10)
    return streams, stopped_at, resumed_at


def score(fault: str, streams: list[Stream], baseline: list[Stream], migrated: int) -> Row:
    """test_faults.py's row (its `score` assumes its own MAX_TOKENS)."""
    done = [s for s in streams if not s.error and s.finish_reason == "length"]
    duplicated = sum(max(0, s.num_tokens - MAX_TOKENS) for s in streams)
    wrong = sum(1 for s, b in zip(streams, baseline) if not s.error and s.text != b.text)
    return Row(fault, len(streams), len(done), len(streams) - len(done), duplicated, wrong, migrated)


def migrations(run_dir: Path) -> int:
    return (run_dir / "gateway.log").read_text(errors="replace").count("migrating ")


@pytest.fixture(scope="module")
def baseline(two_decode) -> list[Stream]:
    streams, _, _ = asyncio.run(run_streams(two_decode[0]))
    assert all(not s.error and s.num_tokens == MAX_TOKENS for s in streams), [s.error for s in streams]
    return streams


@dataclass
class Freeze:
    streams: list[Stream]
    live: list[Stream]
    frozen: list[Stream]
    live_gaps: list[float]
    row: Row


def freeze(two_decode, baseline: list[Stream], stop_s: float, gap_bound_s: float) -> Freeze:
    """Run the streams with worker-decode-0 frozen for `stop_s`; sort them by where they were."""
    system, run_dir = two_decode
    # Balancers route on load reports up to one interval old (plus what they routed since): right
    # after a run ends, a worker still reported busy would get every new stream. Let both report
    # idle first, so the streams spread over the two decode workers.
    time.sleep(4 * REPORT_INTERVAL_S)
    migrated_before = migrations(run_dir)
    streams, stopped_at, resumed_at = asyncio.run(run_streams(system, system.pids["worker-decode-0"], stop_s))
    # a stream with no token in the freeze (bar its first and last moments) was on the frozen worker
    margin = 0.05  # tokens published just before SIGSTOP may still be in flight
    quiet_until = stopped_at + min(stop_s - margin, 0.6)  # before any migrated stream can resume
    # a stream that had ended when the freeze began was on neither (the tiny model streams fast: one may)
    running = [s for s in streams if s.arrivals and s.arrivals[-1] > stopped_at + margin]
    live = [s for s in running if any(stopped_at + margin < t < quiet_until for t in s.arrivals)]
    frozen = [s for s in running if s not in live]
    live_gaps = [max(s.gaps_within(stopped_at + margin, resumed_at), default=0.0) for s in live]
    frozen_gaps = [max(s.gaps_within(stopped_at - 1, resumed_at + 5), default=0.0) for s in frozen]
    unloaded_gaps = [max(s.gaps_within(s.arrivals[1], s.arrivals[-1]), default=0.0) for s in baseline]
    row = score(f"SIGSTOP decode worker {stop_s:g} s", streams, baseline, migrations(run_dir) - migrated_before)
    print(
        f"\nfreeze {stop_s:g} s: {len(live)} streams on the live worker, max gap during the freeze "
        f"{[round(g, 3) for g in live_gaps]} s (fault-free run: {[round(g, 3) for g in unloaded_gaps]} s), "
        f"tokens during it {[len(s.gaps_within(stopped_at, resumed_at)) for s in live]}; "
        f"{len(frozen)} on the frozen one, max gap {[round(g, 3) for g in frozen_gaps]} s"
        f"\n{HEADER}\n{row.line()}"
    )
    assert live and frozen, "the freeze hit no stream, or every stream: the test proved nothing"
    assert all(len(s.gaps_within(stopped_at, resumed_at)) >= 5 for s in live), "live streams did not run"
    assert all(g < gap_bound_s for g in live_gaps), live_gaps
    assert row.lost == 0 and row.duplicated_tokens == 0 and row.wrong_text == 0, (row, [s.error for s in streams])
    return Freeze(streams, live, frozen, live_gaps, row)


def test_long_freeze_other_worker_streams_on_and_frozen_streams_migrate(two_decode, baseline):
    result = freeze(two_decode, baseline, LONG_STOP_S, GAP_BOUND_S)
    assert result.row.migrated >= len(result.frozen), "the frozen worker's streams were not migrated"


def test_short_freeze_frozen_streams_resume_after_sigcont(two_decode, baseline):
    result = freeze(two_decode, baseline, SHORT_STOP_S, SHORT_STOP_S)
    assert result.row.migrated == 0, "a freeze shorter than the loss rule should not migrate"
