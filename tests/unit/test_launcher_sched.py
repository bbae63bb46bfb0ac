"""`ferry up`'s support processes (a niceness given) run SCHED_BATCH on Linux: they do not preempt the
workers' OpenMP threads on every wake-up (issue #22); FERRY_SUPPORT_SCHED_BATCH=0 keeps the normal policy."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

from ferry.launcher import up

pytestmark = [pytest.mark.unit, pytest.mark.skipif(sys.platform != "linux", reason="Linux scheduling policies")]


def _policy_of_child(nice: int) -> tuple[int, int]:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        preexec_fn=functools.partial(up._prepare_child, nice),
    )
    try:
        return os.sched_getscheduler(child.pid), os.getpriority(os.PRIO_PROCESS, child.pid)
    finally:
        child.communicate(b"")


@pytest.mark.parametrize(
    "env, nice, policy", [(None, 5, "SCHED_BATCH"), ("0", 5, "SCHED_OTHER"), (None, 0, "SCHED_OTHER")]
)
def test_a_niced_support_process_runs_sched_batch_unless_turned_off(monkeypatch, env, nice, policy):
    if env is None:
        monkeypatch.delenv("FERRY_SUPPORT_SCHED_BATCH", raising=False)
    else:
        monkeypatch.setenv("FERRY_SUPPORT_SCHED_BATCH", env)
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert _policy_of_child(nice) == (getattr(os, policy), min(own + nice, 19))
