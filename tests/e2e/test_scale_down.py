"""Scale-down under load: the whole system, one process per service (as `ferry up` plans them),
greedy streams running, then one of the two decode workers gets SIGTERM, as compose or Kubernetes
send it when a replica goes. It stops pulling, and the sequences it cannot finish within
FERRY_SHUTDOWN_GRACE_S move to the other decode worker (KV and tokens so far, through the store
and the decode-balancer). Every request must complete with the fault-free run's text: none lost,
no token missing or repeated. The same for a prefill worker, which finishes or gives back its work.

Prints rows in test_faults.py's table format. Loopback only; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import re
import signal

import pytest
from test_faults import ENV, HEADER, FaultSystem, Outcome, Row, check, launch, migrations, run_load

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GRACE_S = 0.2
"""FERRY_SHUTDOWN_GRACE_S: far shorter than a stream, so the SIGTERMed worker has streams to move."""
MAX_TOKENS = 1200
"""Streams of a few seconds even on a quiet machine (the tiny model steps in about a millisecond);
6 of them still fit the one decode worker left (512 blocks of 16 tokens)."""
EXIT_TIMEOUT_S = 30.0
HANDED_ON = re.compile(r"shutdown: (\d+) sequences handed on, (\d+) left to the gateway to migrate, (\d+) given back")


@pytest.fixture(scope="module")
def scale_system(e2e_model, tmp_path_factory):
    system = launch(e2e_model, tmp_path_factory.mktemp("scale"), {**ENV, "FERRY_SHUTDOWN_GRACE_S": str(GRACE_S)})
    yield system
    system.stop()


@pytest.fixture(scope="module")
def baseline(scale_system) -> list[Outcome]:
    outcomes = asyncio.run(run_load(scale_system, max_tokens=MAX_TOKENS))
    assert all(not o.error and o.num_tokens == MAX_TOKENS for o in outcomes), outcomes
    return outcomes


@pytest.fixture(scope="module")
def table(request):
    rows: list[Row] = []
    yield rows
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown even without -s
        print("\n".join(["", "scale-down table", HEADER, *(r.line() for r in rows)]), flush=True)


def terminate(system: FaultSystem, name: str) -> None:
    """SIGTERM one service, as an orchestrator scaling down does; it drains on its own."""
    system.children[name].process.send_signal(signal.SIGTERM)
    system.killed.add(name)


def exit_code(system: FaultSystem, name: str) -> int:
    return system.children[name].process.wait(timeout=EXIT_TIMEOUT_S)


def test_sigterm_decode_worker_under_load_moves_its_streams_with_nothing_lost(scale_system, baseline, table):
    before = migrations(scale_system)
    leaving: list[str] = []

    async def scale_down_busiest_decode_worker() -> None:
        leaving.append(await scale_system.busiest("decode"))
        terminate(scale_system, leaving[0])

    outcomes = asyncio.run(run_load(scale_system, scale_down_busiest_decode_worker, 10, MAX_TOKENS))
    check(scale_system, table, "SIGTERM decode worker under load", outcomes, baseline, before)
    assert exit_code(scale_system, leaving[0]) == 0
    summary = HANDED_ON.search(scale_system.log(leaving[0]))
    assert summary is not None, scale_system.log(leaving[0])[-2000:]
    assert int(summary.group(1)) >= 1, "no stream was running there at SIGTERM: the test proved nothing"
    # and the system still serves exactly with the decode worker that is left
    outcomes = asyncio.run(run_load(scale_system, max_tokens=MAX_TOKENS))
    check(scale_system, table, "after the scale-down", outcomes, baseline, before)


def test_sigterm_prefill_worker_as_requests_arrive_loses_nothing(scale_system, baseline, table):
    before = migrations(scale_system)

    async def scale_down_prefill_worker_soon() -> None:
        await asyncio.sleep(0.05)  # the requests are on their way: some may be in its queue or engine
        terminate(scale_system, "worker-prefill-0")

    outcomes = asyncio.run(run_load(scale_system, scale_down_prefill_worker_soon, 0, MAX_TOKENS))
    check(scale_system, table, "SIGTERM prefill worker", outcomes, baseline, before)
    assert exit_code(scale_system, "worker-prefill-0") == 0
