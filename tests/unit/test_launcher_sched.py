"""A thread runs SCHED_BATCH only while its process is busy (`ferry.sched.BatchWhenBusy`): under a burst
its wake-ups then do not preempt the workers' OpenMP threads, at low load it still wakes at once
(issue #22). `ferry up` nices its support processes and turns it on for the gateway on small machines."""

from __future__ import annotations

import argparse
import os
import sys
import threading

import pytest

from ferry.launcher.up import add_arguments, plan_services, resolve_layout
from ferry.sched import BatchWhenBusy

pytestmark = [pytest.mark.unit, pytest.mark.skipif(sys.platform != "linux", reason="Linux scheduling policies")]


def _policies(busy_from: int, loads: list[int]) -> list[int]:
    """The policy after each update, read by the kernel, on a thread of its own (the test's keeps SCHED_OTHER)."""
    seen: list[int] = []

    def run() -> None:
        busy = BatchWhenBusy(busy_from)
        for load in loads:
            busy.update(load)
            seen.append(os.sched_getscheduler(threading.get_native_id()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen


def test_a_thread_runs_sched_batch_from_busy_and_back_under_half_of_it():
    batch, other = os.SCHED_BATCH, os.SCHED_OTHER
    got = _policies(16, [0, 15, 16, 40, 9, 8, 7, 12, 16, 0])
    assert got == [other, other, batch, batch, batch, batch, other, other, batch, other]
    assert os.sched_getscheduler(threading.get_native_id()) == other  # only the calling thread switched


def test_zero_never_switches_and_a_negative_threshold_is_refused():
    assert _policies(0, [0, 100, 1000]) == [os.SCHED_OTHER] * 3
    with pytest.raises(ValueError, match="busy_from -1"):
        BatchWhenBusy(-1)


def _gateway_env(num_cores: int, *argv: str) -> dict[str, str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(list(argv))
    resolve_layout(args, num_cores=num_cores)
    specs = plan_services(args, "/m", "nats://n", "redis://r")
    (gateway,) = [s for s in specs if s.kind == "gateway"]
    assert gateway.nice == args.support_nice
    return gateway.env


def test_ferry_up_turns_it_on_for_a_niced_gateway_only(monkeypatch):
    monkeypatch.delenv("FERRY_SCHED_BATCH_FROM", raising=False)
    assert _gateway_env(2)["FERRY_SCHED_BATCH_FROM"] == "4"  # small machine: niced
    assert _gateway_env(16)["FERRY_SCHED_BATCH_FROM"] == "0"  # big one: no niceness, nothing to yield
    assert _gateway_env(2, "--support-nice", "0")["FERRY_SCHED_BATCH_FROM"] == "0"
    monkeypatch.setenv("FERRY_SCHED_BATCH_FROM", "0")
    assert _gateway_env(2)["FERRY_SCHED_BATCH_FROM"] == "0"
