"""Prefill and decode workers with both balancers, over real nats-server and redis-server, in one
process: the system's request path without the gateway. Greedy output equals the engine run
in-process; KV really travels through Redis; cancel frees blocks; missing blocks are recomputed
and counted."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from waiting import wait_until

from ferry.bus import connect, ensure_work_stream
from ferry.kvstore import KvStore, RedisTransport
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
from ferry_services.decode_balancer.service import DecodeBalancer
from ferry_services.decode_balancer.settings import DecodeBalancerSettings
from ferry_services.prefill_balancer.service import PrefillBalancer
from ferry_services.prefill_balancer.settings import PrefillBalancerSettings
from ferry_services.worker.service import build_engine, make_worker
from ferry_services.worker.settings import WorkerSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [list(range(3, 3 + n)) for n in (5, 16, 37, 70)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ferry.model.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny") / "tiny", "llama", "tiny")


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy tokens of every prompt from the engine in-process (role 'both')."""
    from ferry.engine import EngineConfig, LLMEngine

    engine = LLMEngine.from_model_path(tiny_model, EngineConfig(num_kv_blocks=128))
    tokens = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


class System:
    """Both balancers and one worker per role, each on its own NATS connection; `worker_overrides`
    are WorkerSettings fields for every worker, `role_overrides` ({role: fields}) for one role's."""

    def __init__(self, nats_url: str, redis_url: str, model, role_overrides=None, **worker_overrides) -> None:
        self.nats_url, self.redis_url, self.model = nats_url, redis_url, model
        self.worker_overrides = worker_overrides
        self.role_overrides = role_overrides or {}
        self.conns, self.tasks, self.stoppers, self.balancers = [], [], [], []
        self.workers = {}
        self.worker_tasks: dict[str, list[asyncio.Task]] = {}

    async def start(self) -> None:
        for cls, settings in (
            (PrefillBalancer, PrefillBalancerSettings(tick_s=0.2)),
            (DecodeBalancer, DecodeBalancerSettings(tick_s=0.2)),
        ):
            nc = await self._connect()
            await ensure_work_stream(nc.jetstream())
            balancer = cls(nc, settings)
            await balancer.start()
            self.balancers.append(balancer)
            self.stoppers.append(balancer.stop)
        for role in ("prefill", "decode"):
            await self.start_worker(role, f"{role}-t")

    async def start_worker(self, role: str, worker_id: str, **overrides):
        fields = {
            "num_kv_blocks": 64,
            "max_running": 8,
            "load_interval_s": 0.2,
            **self.worker_overrides,
            **self.role_overrides.get(role, {}),
            **overrides,
        }
        settings = WorkerSettings(
            role=role, model=str(self.model), worker_id=worker_id, redis_url=self.redis_url, **fields
        )
        engine = await asyncio.to_thread(build_engine, settings)
        nc = await self._connect()
        transport = RedisTransport(self.redis_url)
        worker = make_worker(nc, settings, engine, KvStore(transport, engine.kv_namespace))
        await worker.start()
        await worker.service.start(nc)
        self.worker_tasks[worker_id] = [asyncio.create_task(c) for c in worker.background()]
        self.tasks += self.worker_tasks[worker_id]
        self.stoppers.append(transport.close)
        self.workers[worker_id] = worker
        return worker

    async def stop_worker(self, worker_id: str) -> None:
        """What SIGTERM does to a worker process (ferry.bus.run_service): stop its subscriptions,
        `shutdown` (drain), then end its loops; it falls silent to the balancers."""
        worker = self.workers[worker_id]
        await worker.service.stop()
        await worker.shutdown()
        for task in self.worker_tasks[worker_id]:
            task.cancel()
        await asyncio.gather(*self.worker_tasks[worker_id], return_exceptions=True)

    def seen(self, worker_id: str):
        """The balancers' last view of a worker (its load report and when it came), or None."""
        states = (b.runtime.view.workers.get(worker_id) for b in self.balancers)
        return next((s for s in states if s is not None), None)

    async def until_reported(self, *worker_ids: str) -> None:
        """Wait until the balancers hold a load report from each worker (every started one by
        default) received after this call: new workers are routable, the views are fresh."""
        since, ids = time.monotonic(), worker_ids or tuple(self.workers)

        def fresh() -> bool:
            return all((s := self.seen(w)) is not None and s.received_at > since for w in ids)

        await wait_until(fresh, f"load reports from {', '.join(ids)} reach the balancers")

    async def _connect(self):
        nc = await connect(self.nats_url, "ferry-test-system")
        self.conns.append(nc)
        return nc

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        _, pending = await asyncio.wait(self.tasks, timeout=10) if self.tasks else (set(), set())
        assert not pending, f"background loops ignored their cancellation: {pending}"
        for worker in self.workers.values():
            worker.compute.close()
        for stop in self.stoppers:
            with contextlib.suppress(Exception):
                await stop()
        for nc in self.conns:
            await nc.close()


@pytest.fixture
async def system(nc, nats_url, redis_url, redis, tiny_model):
    system = System(nats_url, redis_url, tiny_model)
    await system.start()
    await system.until_reported()
    yield system
    await system.stop()


class Client:
    """A gateway stand-in: submits, and gathers every token event of gateway 'gw'."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.errors = []
        self.workers_seen: dict[str, set[str]] = {}
        self.event_sizes: dict[str, list[int]] = {}

    async def start(self) -> None:
        await self.nc.subscribe(subjects.out("gw"), cb=self._on_output)

    async def _on_output(self, msg) -> None:
        batch = decode(msg.data, OutputBatch)
        self.errors += batch.errors
        for event in batch.tokens:
            got = self.tokens.setdefault(event.request_id, [])
            assert event.index == len(got), f"{event.request_id}: index {event.index} after {len(got)} tokens"
            got.extend(event.token_ids)
            self.event_sizes.setdefault(event.request_id, []).append(len(event.token_ids))
            self.workers_seen.setdefault(event.request_id, set()).add(batch.worker_id)
            if event.finish_reason:
                self.finished[event.request_id] = event.finish_reason

    async def submit(self, request_id: str, prompt: list[int], sampling=GREEDY) -> SubmitReply:
        request = GenerateRequest(
            request_id=request_id, gateway_id="gw", model="tiny", prompt_token_ids=prompt, sampling=sampling
        )
        reply = await self.nc.request(subjects.SUBMIT, encode(SubmitRequest(request)), timeout=5)
        return decode(reply.data, SubmitReply)

    async def wait_finished(self, request_ids, timeout_s: float = 60.0) -> None:
        async def done():
            while not set(request_ids) <= set(self.finished) and not self.errors:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(done(), timeout_s)


@pytest.fixture
async def client(nc):
    c = Client(nc)
    await c.start()
    return c


async def test_greedy_output_through_both_workers_equals_the_engine_in_process(system, client, reference):
    replies = [await client.submit(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    assert all(r.accepted for r in replies), replies
    await client.wait_finished([f"r{i}" for i in range(len(PROMPTS))])
    assert client.errors == []
    assert client.tokens == reference
    assert set(client.finished.values()) == {"length"}
    assert all(seen == {"prefill-t", "decode-t"} for seen in client.workers_seen.values())
    decode_worker = system.workers["decode-t"]
    assert (decode_worker.num_transferred, decode_worker.num_recomputed) == (len(PROMPTS), 0)
    assert system.workers["prefill-t"].handoffs.num_accepted == len(PROMPTS)


async def test_tokens_held_back_per_stream_arrive_whole_and_in_order(
    nc, nats_url, redis_url, redis, tiny_model, reference
):
    """FERRY_STREAM_INTERVAL_MS: the first token at once (from the prefill worker), the decode worker's
    tokens in fewer, larger events (Client checks every event's index), the last one with the finish."""
    system = System(nats_url, redis_url, tiny_model, stream_interval_ms=300)
    await system.start()
    await system.until_reported()
    try:
        client = Client(nc)
        await client.start()
        replies = [await client.submit(f"r{i}", p) for i, p in enumerate(PROMPTS)]
        assert all(r.accepted for r in replies), replies
        await client.wait_finished([f"r{i}" for i in range(len(PROMPTS))])
        assert client.errors == []
        assert client.tokens == reference
        assert all(sizes[0] == 1 for sizes in client.event_sizes.values())
        assert sum(len(sizes) for sizes in client.event_sizes.values()) < sum(map(len, reference.values()))
        assert system.workers["decode-t"].stream.num_held == 0
    finally:
        await system.stop()


async def test_missing_kv_blocks_are_recomputed_counted_and_still_exact(system, client, reference, redis):
    prefill = system.workers["prefill-t"]

    class Forgetful:  # a store whose writes vanish, as if Redis evicted every block at once
        namespace = prefill.store.namespace

        async def lookup(self, hashes):  # nothing stays stored: no prefix to reuse
            return 0

        async def num_leading_stored(self, hashes):
            return 0

        async def put_blocks(self, hashes, data):
            await prefill_store.put_blocks(hashes, data)
            await redis.flushdb()

    prefill_store = prefill.store
    prefill.store = prefill.handoffs.store = Forgetful()  # prefix lookups and hand-off writes
    await client.submit("r2", PROMPTS[2])
    await client.wait_finished(["r2"])
    assert client.tokens["r2"] == reference["r2"]
    assert system.workers["decode-t"].num_recomputed == 1


async def test_a_hand_off_with_no_room_waits_in_the_decode_worker_and_is_never_lost(system, client, reference):
    """The decode worker finds no room for a hand-off the balancer sent it (its view was stale: after a restart,
    or sequences grew since the last report) for 3.5 s. The hand-off waits in the worker and joins once there is
    room. It used to go back to JetStream every 0.5 s, and after max_deliver (5) deliveries JetStream dropped it:
    the request was lost (issue #21's restart bench lost one per mode that way)."""
    decode_worker = system.workers["decode-t"]
    engine, refused_until, refusals = decode_worker.engine, time.monotonic() + 3.5, []

    def can_admit(num_tokens: int) -> bool:  # a pool full of sequences the balancer did not know about
        if time.monotonic() < refused_until:
            refusals.append(num_tokens)
            return False
        return type(engine).can_admit(engine, num_tokens)

    engine.can_admit = can_admit
    assert (await client.submit("r3", PROMPTS[3])).accepted
    await client.wait_finished(["r3"], timeout_s=30)
    assert client.errors == [] and client.tokens["r3"] == reference["r3"]
    assert len(refusals) >= 6, f"refused {len(refusals)} times: the test must outlast 5 redeliveries"
    assert decode_worker.num_transferred == 1 and len(decode_worker.ledger) == 0


async def test_a_sequence_longer_than_every_decode_pool_gets_an_error_at_once(
    nc, nats_url, redis_url, redis, tiny_model, client
):
    """A decode pool (4 blocks) smaller than the prefill worker's: a 70-token prompt is prefilled, but no decode
    worker can ever hold it. The client hears so at once, as a bad request that says why, instead of an
    'overloaded' after a minute of hand-off retries."""
    system = System(nats_url, redis_url, tiny_model, role_overrides={"decode": {"num_kv_blocks": 4}})
    await system.start()
    await system.until_reported()
    try:
        started = time.monotonic()
        assert (await client.submit("r3", PROMPTS[3])).accepted
        await wait_until(lambda: client.errors, "an error event for r3", timeout_s=20)
        (error,) = client.errors
        assert (error.request_id, error.code, error.retryable) == ("r3", "bad_request", False)
        assert "too_long: 70 tokens need 5 KV blocks, the largest decode worker's pool has 4" in error.message
        assert time.monotonic() - started < 10
        await wait_until(lambda: not len(system.workers["prefill-t"].ledger), "the prefill worker lets go of r3")
    finally:
        await system.stop()


async def test_cancel_mid_stream_frees_blocks_on_every_worker(system, client):
    long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)  # 36 of the 64 blocks
    assert (await client.submit("long", PROMPTS[3], long)).accepted
    for _ in range(1000):
        if len(client.tokens.get("long", [])) >= 5 or client.errors:
            break
        await asyncio.sleep(0.02)
    assert client.errors == [] and len(client.tokens["long"]) >= 5
    decode_worker = system.workers["decode-t"]
    assert decode_worker.compute.stats.kv_blocks_used > 0
    await client.nc.publish(subjects.CANCEL, encode(Cancel(["long"])))
    for _ in range(200):
        if all(w.compute.stats.kv_blocks_used == 0 and not len(w.ledger) for w in system.workers.values()):
            break
        await asyncio.sleep(0.05)
    assert [(w.worker_id, w.compute.stats.kv_blocks_used, len(w.ledger)) for w in system.workers.values()] == [
        ("prefill-t", 0, 0),
        ("decode-t", 0, 0),
    ]
    assert "long" not in client.finished


async def test_the_decode_worker_steps_on_while_a_step_is_published(system, client, reference):
    """Pipelined engine loop: while the asyncio side still handles step N's tokens (here held up on
    purpose), steps N+1 .. N+depth (FERRY_PIPELINE_DEPTH, default 2) already run on the engine thread;
    the tokens stay exact and in order."""
    decode_worker = system.workers["decode-t"]
    original = decode_worker.after_step
    steps_while_held = []

    async def slow_after_step(outputs):  # the engine loop awaits it: never two at once
        if outputs and not steps_while_held:
            start = decode_worker.engine.stats().num_steps
            await asyncio.sleep(0.3)  # a tiny-model step takes about a millisecond
            steps_while_held.append(decode_worker.engine.stats().num_steps - start)
        await original(outputs)

    decode_worker.after_step = slow_after_step
    try:
        assert (await client.submit("r1", PROMPTS[1])).accepted
        await client.wait_finished(["r1"])
    finally:
        decode_worker.after_step = original
    assert decode_worker.settings.pipeline_depth == 2
    assert steps_while_held == [2]  # exactly `depth` steps queued ahead, not more
    assert client.errors == [] and client.tokens["r1"] == reference["r1"]
