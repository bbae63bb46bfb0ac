"""Workers and migration attempts, over real nats-server and redis-server (both balancers, one
worker per role, in this process; the harness of test_worker_pipeline). A newer attempt of a request
replaces the older copy a worker holds; `Cancel(below_attempt=n)` stops only older attempts; every
event says which attempt made it; a continued request ends with the fault-free run's tokens."""

from __future__ import annotations

import asyncio

import pytest
from test_worker_pipeline import PROMPTS, System, tiny_model  # noqa: F401  (tiny_model: a fixture)
from waiting import wait_until

from ferry.protocol import (
    Cancel,
    GenerateRequest,
    OutputBatch,
    SamplingParams,
    SubmitReply,
    SubmitRequest,
    decode,
    encode,
    subjects,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG = SamplingParams(max_tokens=800, temperature=0, ignore_eos=True)
"""Long enough (seconds) that an attempt is still running when the test sends the next one, and
short enough for the workers' 64-block pools (1024 tokens)."""
GREEDY_SHORT = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class AttemptClient:
    """Gathers events of gateway 'gw-att' per (request, attempt)."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.events: dict[tuple[str, int], list] = {}
        self.errors = []

    async def start(self) -> None:
        await self.nc.subscribe(subjects.out("gw-att"), cb=self._on_output)

    async def _on_output(self, msg) -> None:
        batch = decode(msg.data, OutputBatch)
        self.errors += batch.errors
        for event in batch.tokens:
            self.events.setdefault((event.request_id, event.attempt), []).append(event)

    def tokens(self, request_id: str, attempt: int) -> list[int]:
        return [t for e in self.events.get((request_id, attempt), []) for t in e.token_ids]

    def finished(self, request_id: str, attempt: int) -> bool:
        return any(e.finish_reason for e in self.events.get((request_id, attempt), []))

    async def submit(self, request: GenerateRequest) -> SubmitReply:
        reply = await self.nc.request(subjects.SUBMIT, encode(SubmitRequest(request)), timeout=5)
        return decode(reply.data, SubmitReply)


@pytest.fixture
async def system(nc, nats_url, redis_url, redis, tiny_model):
    system = System(nats_url, redis_url, tiny_model)
    await system.start()
    await system.until_reported()
    yield system
    await system.stop()


@pytest.fixture
async def client(nc):
    c = AttemptClient(nc)
    await c.start()
    return c


def request(attempt: int = 0, output: list[int] | None = None, sampling=LONG) -> GenerateRequest:
    return GenerateRequest(
        "mig", "gw-att", "tiny", PROMPTS[1], sampling, output_token_ids=output or [], attempt=attempt
    )


async def test_a_newer_attempt_replaces_the_older_copy_and_continues_exactly(system, client, nc):
    full = await full_run(system, client, nc)
    assert (await client.submit(request())).accepted
    await wait_until(lambda: len(client.tokens("mig", 0)) >= 8, "len(client.tokens('mig', 0)) >= 8", 60)
    await nc.publish(subjects.CANCEL, encode(Cancel(["mig"], "migrated", below_attempt=0)))  # cancels nothing
    so_far = client.tokens("mig", 0)
    assert (await client.submit(request(1, so_far))).accepted
    await wait_until(lambda: client.finished("mig", 1), "client.finished('mig', 1)", 60)
    assert client.errors == []
    first = client.events[("mig", 1)][0]
    assert first.index == len(so_far)  # continues right after what the client had
    assert so_far + client.tokens("mig", 1) == full
    assert not client.finished("mig", 0)  # the older copy was dropped when the newer one arrived
    decode_worker = system.workers["decode-t"]
    assert len(decode_worker.ledger) == 0 and decode_worker.compute.stats.kv_blocks_used == 0


async def test_cancel_below_attempt_spares_the_current_attempt(system, client, nc):
    assert (await client.submit(request(2))).accepted
    await wait_until(lambda: len(client.tokens("mig", 2)) >= 3, "len(client.tokens('mig', 2)) >= 3", 60)
    await nc.publish(subjects.CANCEL, encode(Cancel(["mig"], "migrated", below_attempt=2)))
    await wait_until(lambda: client.finished("mig", 2), "client.finished('mig', 2)", 60)
    assert len(client.tokens("mig", 2)) == LONG.max_tokens and client.errors == []
    # an attempt older than the one held is a stale copy: acked and dropped, never run
    assert (await client.submit(request(3))).accepted
    await wait_until(lambda: len(client.tokens("mig", 3)) >= 3, "len(client.tokens('mig', 3)) >= 3", 60)
    assert (await client.submit(request(1))).accepted
    await asyncio.sleep(1.0)  # prefilled (its first token goes out) and handed to the decode worker
    assert len(client.tokens("mig", 1)) <= 1 and not client.finished("mig", 1)
    await nc.publish(subjects.CANCEL, encode(Cancel(["mig"], "done")))  # every attempt
    await wait_until(lambda: all(len(w.ledger) == 0 for w in system.workers.values()), "every worker dropped 'mig'")


async def full_run(system, client, nc) -> list[int]:
    """The fault-free tokens of request 'mig', under another id (same prompt, greedy)."""
    reference_request = GenerateRequest("ref", "gw-att", "tiny", PROMPTS[1], LONG)
    assert (await client.submit(reference_request)).accepted
    await wait_until(lambda: client.finished("ref", 0), "client.finished('ref', 0)", 60)
    return client.tokens("ref", 0)


@pytest.mark.parametrize("where", ["fetch_prefix", "add_to_engine"])
async def test_a_cancel_that_races_the_admission_leaves_nothing_in_the_engine(system, client, nc, where):
    """The gateway migrates a request (Cancel below_attempt=1) while the prefill worker is still
    admitting attempt 0: while its prefix lookup travels, or while the addition waits its turn on the
    engine thread, where the cancel's own abort can run first and find nothing. Either way nothing
    may stay in the engine (CI once saw attempt 1 refused: 'already in the engine', and blocks leak)."""
    worker = system.workers["prefill-t"]
    gate, reached = asyncio.Event(), asyncio.Event()
    original = getattr(worker, where)

    async def gated(*args):
        reached.set()
        await gate.wait()
        return await original(*args)

    setattr(worker, where, gated)
    try:
        assert (await client.submit(request(0, sampling=GREEDY_SHORT))).accepted
        await asyncio.wait_for(reached.wait(), 10)
        await nc.publish(subjects.CANCEL, encode(Cancel(["mig"], "migrated", below_attempt=1)))
        await wait_until(lambda: "mig" not in worker.ledger, "'mig' not in worker.ledger", 10)
        gate.set()
        await wait_until(lambda: not worker.ledger.handles(), "not worker.ledger.handles()", 10)
        await asyncio.sleep(0.3)  # a leftover would be stepped (and hold blocks) by now
    finally:
        setattr(worker, where, original)
    assert not worker.engine.has_unfinished_requests()
    assert worker.engine.stats().kv_blocks_used == 0
    assert client.tokens("mig", 0) == []
    assert (await client.submit(request(1, sampling=GREEDY_SHORT))).accepted
    await wait_until(lambda: client.finished("mig", 1), "client.finished('mig', 1)", 60)
    assert client.errors == [] and len(client.tokens("mig", 1)) == GREEDY_SHORT.max_tokens
