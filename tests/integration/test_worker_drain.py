"""Scale-down of a decode worker (what SIGTERM does: `System.stop_worker`), over real nats-server
and redis-server, with both balancers and the workers in this process (test_worker_pipeline's
harness). Sequences that cannot finish within the grace period move to the other decode worker and
end with exactly the tokens of an undisturbed run; with a long enough grace they finish where they
are while new work goes elsewhere; hand-offs pulled but not started go back to the queue and are
served by the other worker; with nobody to take them, the gateway is told to migrate them."""

from __future__ import annotations

import asyncio

import pytest
from test_worker_pipeline import PROMPTS, Client, System, reference, tiny_model  # noqa: F401  (fixtures)
from waiting import wait_until

from ferry.protocol import SamplingParams, subjects
from ferry_services.worker import decode as decode_module

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
"""Long enough to be mid-stream at shutdown; 3 of them fit one worker's 256 blocks (x 16 tokens)."""
LONG_IDS = ["l0", "l1", "l2"]


@pytest.fixture(scope="module")
def long_reference(tiny_model):
    """Greedy LONG tokens of PROMPTS[:3] from the engine in-process."""
    from ferry.engine import EngineConfig, LLMEngine

    engine = LLMEngine.from_model_path(tiny_model, EngineConfig(num_kv_blocks=256))
    for request_id, prompt in zip(LONG_IDS, PROMPTS):
        engine.add_request(request_id, prompt, LONG)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture
async def system(nc, nats_url, redis_url, redis, tiny_model):
    system = System(nats_url, redis_url, tiny_model, num_kv_blocks=256)
    await system.start()
    await system.until_reported()
    yield system
    await system.stop()


@pytest.fixture
async def client(nc):
    c = Client(nc)
    await c.start()
    return c


async def start_long_streams(client: Client) -> None:
    for request_id, prompt in zip(LONG_IDS, PROMPTS):
        assert (await client.submit(request_id, prompt, LONG)).accepted
    await wait_until(
        lambda: all(len(client.tokens.get(r, [])) >= 5 for r in LONG_IDS) or client.errors,
        "5 tokens of every long stream",
        60,
    )
    assert client.errors == [] and not client.finished, "the streams must still run at shutdown"


def set_grace(worker, grace_s: float) -> None:
    worker.settings = worker.settings.model_copy(update={"shutdown_grace_s": grace_s})


async def test_sequences_that_cannot_finish_in_the_grace_period_move_on_exactly(system, client, long_reference):
    other = await system.start_worker("decode", "decode-2")
    await system.until_reported("decode-2")
    await start_long_streams(client)
    leaving = max((system.workers["decode-t"], other), key=lambda w: len(w.ledger))
    staying = other if leaving is not other else system.workers["decode-t"]
    running_there = set(r.request_id for r in leaving.ledger.requests())
    assert running_there, "no stream on either decode worker"
    transferred, recomputed = staying.num_transferred, staying.num_recomputed
    set_grace(leaving, 0.0)
    await system.stop_worker(leaving.worker_id)
    assert leaving.num_moved == len(running_there) and len(leaving.ledger) == 0
    await client.wait_finished(LONG_IDS)
    assert client.errors == []
    assert client.tokens == long_reference  # nothing lost, nothing twice
    for request_id in running_there:
        assert client.workers_seen[request_id] == {"prefill-t", leaving.worker_id, staying.worker_id}
    # continued from the moved KV, not recomputed
    assert (staying.num_transferred - transferred, staying.num_recomputed - recomputed) == (len(running_there), 0)


async def test_with_a_long_grace_period_they_finish_where_they_are_and_new_work_goes_elsewhere(
    system, client, long_reference, reference
):
    leaving = system.workers["decode-t"]
    await start_long_streams(client)  # all on decode-t: the only decode worker yet
    other = await system.start_worker("decode", "decode-2")
    await system.until_reported("decode-2")
    set_grace(leaving, 120.0)
    stopping = asyncio.create_task(system.stop_worker("decode-t"))
    await wait_until(lambda: system.seen("decode-t").report.draining, "decode-t's draining report reaches the balancer")
    assert (await client.submit("r1", PROMPTS[1])).accepted  # arrives while decode-t drains
    await asyncio.wait_for(stopping, 120)
    await client.wait_finished([*LONG_IDS, "r1"])
    assert client.errors == [] and leaving.num_moved == 0
    assert {r: client.tokens[r] for r in LONG_IDS} == long_reference and client.tokens["r1"] == reference["r1"]
    assert all(client.workers_seen[r] == {"prefill-t", "decode-t"} for r in LONG_IDS)
    assert client.workers_seen["r1"] == {"prefill-t", other.worker_id}


async def test_hand_offs_pulled_but_not_started_go_back_and_are_served_by_another_worker(system, client, reference):
    leaving = system.workers["decode-t"]
    gate = asyncio.Event()
    original = leaving.fetch_kv

    async def stuck(handoff):  # its KV never arrives while the worker is up
        await gate.wait()
        return await original(handoff)

    leaving.fetch_kv = stuck
    try:
        for i in (0, 2):
            assert (await client.submit(f"r{i}", PROMPTS[i])).accepted
        await wait_until(lambda: len(leaving.ledger) == 2, "len(leaving.ledger) == 2", 60)
        await system.start_worker("decode", "decode-2")
        set_grace(leaving, 0.0)
        await system.stop_worker("decode-t")  # gives both back; the balancer moves its queue once it is silent
        await client.wait_finished(["r0", "r2"])
    finally:
        gate.set()
    assert client.errors == [] and leaving.num_moved == 0
    assert {r: client.tokens[r] for r in ("r0", "r2")} == {r: reference[r] for r in ("r0", "r2")}
    assert all(client.workers_seen[r] == {"prefill-t", "decode-2"} for r in ("r0", "r2"))


async def test_with_no_decode_worker_left_the_gateway_is_told_to_migrate(system, client, monkeypatch):
    monkeypatch.setattr(decode_module, "MOVE_TIMEOUT_S", 1.0)
    leaving = system.workers["decode-t"]
    await start_long_streams(client)
    set_grace(leaving, 0.0)
    await system.stop_worker("decode-t")
    assert leaving.num_moved == 0
    await wait_until(lambda: len(client.errors) == len(LONG_IDS), "len(client.errors) == len(LONG_IDS)", 10)
    assert sorted(e.request_id for e in client.errors) == LONG_IDS
    assert all(e.code == "worker_lost" and e.retryable and e.attempt == 0 for e in client.errors)


async def test_a_prefill_worker_gives_what_it_could_not_finish_back_to_the_gateway(system, client, js):
    leaving = system.workers["prefill-t"]
    gate = asyncio.Event()
    original = leaving.fetch_kv

    async def stuck(work):  # the prefix lookup never returns while the worker is up
        await gate.wait()
        return await original(work)

    leaving.fetch_kv = stuck
    try:
        assert (await client.submit("r2", PROMPTS[2])).accepted
        await wait_until(lambda: len(leaving.ledger) == 1, "len(leaving.ledger) == 1", 60)
        set_grace(leaving, 0.0)
        await system.stop_worker("prefill-t")
    finally:
        gate.set()
    await wait_until(lambda: len(client.errors) == 1, "len(client.errors) == 1", 10)
    (error,) = client.errors
    assert (error.request_id, error.code, error.retryable, error.attempt) == ("r2", "worker_lost", True, 0)
    consumer = subjects.work_consumer("prefill", "prefill-t")

    async def settled() -> bool:  # acked: no second copy for the balancer to move
        info = await js.consumer_info(subjects.WORK_STREAM, consumer)
        return info.num_pending == 0 and info.num_ack_pending == 0

    for _ in range(100):
        if await settled():
            break
        await asyncio.sleep(0.05)
    assert await settled()
    assert client.tokens == {}
