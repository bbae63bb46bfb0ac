"""The admission window (services/worker/window.py) on a real both-roles worker over nats-server: a
burst queued in JetStream, pulled one message at a time (as it trickles in over HTTP), is prefilled in
one engine step; without the window the first step starts before the rest have arrived. And the pull loop
does not wait for the engine (admission.py): messages that arrive while a long step runs are pulled
and their additions queued before it ends, so they all join the next step."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from waiting import wait_until

from ferry.bus import ensure_work_stream, publish_work
from ferry.kvstore import KvStore, RedisTransport
from ferry.protocol import GenerateRequest, PrefillWork, SamplingParams
from ferry_services.worker import pulling
from ferry_services.worker.service import build_engine, make_worker
from ferry_services.worker.settings import WorkerSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_REQUESTS = 6
SAMPLING = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ferry.model.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny") / "tiny", "llama", "tiny")


@contextlib.asynccontextmanager
async def both_worker(nc, redis_url, tiny_model, worker_id: str, window_ms: float = 20.0, **overrides):
    """A both-roles worker, started (consumer open) but its loops not running yet."""
    settings = WorkerSettings(
        role="both",
        model=str(tiny_model),
        worker_id=worker_id,
        redis_url=redis_url,
        num_kv_blocks=64,
        max_running=8,
        kv_writeback=False,
        admission_window_ms=window_ms,
        **overrides,
    )
    await ensure_work_stream(nc.jetstream())
    engine = await asyncio.to_thread(build_engine, settings)
    transport = RedisTransport(redis_url)
    worker = make_worker(nc, settings, engine, KvStore(transport, engine.kv_namespace))
    await worker.start()
    try:
        yield worker
    finally:
        worker.compute.close()
        await transport.close()


@contextlib.asynccontextmanager
async def running(worker):
    tasks = [asyncio.create_task(loop) for loop in worker.background()]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def work(
    request_id: str, prompt_len: int, sampling: SamplingParams = SAMPLING, num_routing_behind: int = 0
) -> PrefillWork:
    request = GenerateRequest(request_id, "gw-window", "tiny", list(range(3, 3 + prompt_len)), sampling)
    return PrefillWork(request, num_routing_behind=num_routing_behind)


def record_steps(worker) -> tuple[list[int], set[str]]:
    """The sequences of every step that produced outputs, and the requests finished, as the worker runs."""
    step_sizes: list[int] = []
    finished: set[str] = set()
    step = worker.step

    def recorded_step():  # on the engine thread
        outputs = step()
        if outputs:
            step_sizes.append(worker.engine.last_step.num_seqs)
        finished.update(out.request_id.split("@")[0] for out in outputs if out.finish_reason is not None)
        return outputs

    worker.step = recorded_step
    return step_sizes, finished


@pytest.mark.parametrize(("window_ms", "is_together"), [(500.0, True), (0.0, False)])
async def test_a_burst_pulled_one_by_one_is_prefilled_together(
    nc, redis_url, tiny_model, monkeypatch, window_ms, is_together
):
    monkeypatch.setattr(pulling, "MAX_FETCH", 1)  # one message per pull: the burst arrives one by one
    async with both_worker(nc, redis_url, tiny_model, "window-t", window_ms) as worker:
        step_sizes, finished = record_steps(worker)
        for i in range(NUM_REQUESTS):  # queued before the worker pulls: the first pull sees the rest behind it
            await publish_work(nc.jetstream(), "prefill", "window-t", work(f"w{i}", 9 + i))
        async with running(worker):
            await wait_until(lambda: len(finished) == NUM_REQUESTS, "every request finished", 30)
        # without the window the first step is queued once the first prompt's addition is: the
        # others, pulled one by one meanwhile (the pull loop does not wait for it), join some of it at most
        assert (step_sizes[0] == NUM_REQUESTS) is is_together


@pytest.mark.parametrize(("burst_ms", "is_together"), [(2000.0, True), (0.0, False)])
async def test_an_idle_engines_first_step_waits_for_what_the_balancer_still_routes(
    nc, redis_url, tiny_model, burst_ms, is_together
):
    """The first message of a burst reaches an idle worker while the balancer still routes the other 5
    (it says so: num_routing_behind=5), and they reach JetStream only 0.3 s later (a balancer busy
    routing). With FERRY_ADMISSION_BURST_MS the first step waits for them and runs all 6 together; without
    it (0: the 20 ms window only, which knew nothing of the balancer) the first prompt ran alone and the
    burst's other prompts waited for that step (issue #22: 155-170 ms of SmolLM2 on the Xeon box)."""
    js = nc.jetstream()
    worker_id = f"burst-{int(burst_ms)}"
    async with both_worker(nc, redis_url, tiny_model, worker_id, admission_burst_ms=burst_ms) as worker:
        step_sizes, finished = record_steps(worker)
        names = [f"b{i}" for i in range(NUM_REQUESTS)]
        async with running(worker):
            await publish_work(js, "prefill", worker_id, work(names[0], 9, num_routing_behind=NUM_REQUESTS - 1))
            await asyncio.sleep(0.3)
            for i, name in enumerate(names[1:], start=1):
                await publish_work(js, "prefill", worker_id, work(name, 9 + i, num_routing_behind=NUM_REQUESTS - 1 - i))
            await wait_until(lambda: finished == set(names), "every request finished", 30)
        assert (step_sizes[0] == NUM_REQUESTS) is is_together


async def test_an_idle_engines_first_step_waits_while_the_burst_keeps_arriving(nc, redis_url, tiny_model):
    """The balancer's queue runs dry mid-burst (the gateway passes a burst on in spurts): 'b' says nothing
    is behind it, yet 'c' follows 50 ms later. Having seen 'b' arrive during its hold, the idle engine's
    first step waits until the burst has been quiet for the window (500 ms here: a loaded machine may stretch a
    50 ms gap several times) and runs all three."""
    js = nc.jetstream()
    async with both_worker(nc, redis_url, tiny_model, "quiet-t", 500.0, admission_burst_ms=3000.0) as worker:
        step_sizes, finished = record_steps(worker)
        async with running(worker):
            await publish_work(js, "prefill", "quiet-t", work("a", 9, num_routing_behind=1))
            for name in ("b", "c"):
                await asyncio.sleep(0.05)
                await publish_work(js, "prefill", "quiet-t", work(name, 10))
            await wait_until(lambda: finished == {"a", "b", "c"}, "every request finished", 30)
        assert step_sizes[0] == 3


async def test_messages_that_arrive_during_a_long_step_join_the_next_one(nc, redis_url, tiny_model):
    """'a' runs alone in a step held on the engine thread (a long prefill); 'b' and then 'c' arrive one
    after the other meanwhile. Both are pulled and their additions queued before that step ends (the
    pull loop once waited for 'b's addition, so 'c' was pulled only after the step, and joined one step
    later whenever the engine had already started the next), and both make their first token in the next step."""
    js = nc.jetstream()
    async with both_worker(nc, redis_url, tiny_model, "pull-t") as worker:
        in_step, release = threading.Event(), threading.Event()
        step_outputs: list[set[str]] = []
        step = worker.step

        def held_step():  # on the engine thread: the first step is held until released
            if not step_outputs:
                in_step.set()
                assert release.wait(30)
            outputs = step()
            step_outputs.append({out.request_id.split("@")[0] for out in outputs})  # engine ids: '<request>@<attempt>'
            return outputs

        worker.step = held_step
        async with running(worker):
            await publish_work(js, "prefill", "pull-t", work("a", 20))
            await wait_until(in_step.is_set, "'a''s step started", 30)
            await publish_work(js, "prefill", "pull-t", work("b", 11))
            await wait_until(lambda: "b" in worker.ledger and worker.num_adding == 1, "'b' pulled and queued", 10)
            await publish_work(js, "prefill", "pull-t", work("c", 13))
            await wait_until(lambda: "c" in worker.ledger, "'c' pulled during the step", 10)
            await wait_until(lambda: worker.num_adding == 2, "'c''s addition queued during the step", 10)
            assert not step_outputs  # the step is still in flight
            release.set()
            await wait_until(lambda: len(step_outputs) >= 2, "two steps ran", 30)
        assert step_outputs[0] == {"a"}
        assert {"b", "c"} <= step_outputs[1]


@pytest.mark.parametrize(("pull_ahead_tokens", "num_pulled"), [(0, 3), (1000, 7)])
async def test_the_worker_pulls_ahead_up_to_pull_ahead_tokens(
    nc, redis_url, tiny_model, monkeypatch, pull_ahead_tokens, num_pulled
):
    """While a step runs, the worker pulls prompts until FERRY_PULL_AHEAD_TOKENS of them wait to be
    prefilled (0: one step's max_batch_tokens, 32 here); the rest stays in JetStream until room frees.
    The engine orders prefills (shortest first) only among the prompts it holds: pulling a burst's
    prompts ahead lets it see them all (issue #22: one step's worth at a time put `ferry up`'s TTFT p50
    far above the in-process engine's on a 48-request burst). Every request still finishes."""
    monkeypatch.setattr(pulling, "MAX_FETCH", 1)  # one message per pull: the count pulled is exact
    js = nc.jetstream()
    worker_id = f"ahead-{pull_ahead_tokens}"
    async with both_worker(
        nc, redis_url, tiny_model, worker_id, max_batch_tokens=32, pull_ahead_tokens=pull_ahead_tokens
    ) as worker:
        in_step, release = threading.Event(), threading.Event()
        finished: set[str] = set()
        step = worker.step

        def held_step():  # on the engine thread: the first step is held until released
            if not in_step.is_set():
                in_step.set()
                assert release.wait(30)
            outputs = step()
            finished.update(out.request_id.split("@")[0] for out in outputs if out.finish_reason is not None)
            return outputs

        worker.step = held_step
        async with running(worker):
            await publish_work(js, "prefill", worker_id, work("a", 20))
            await wait_until(in_step.is_set, "'a''s step started", 30)
            names = [f"q{i}" for i in range(6)]
            for name in names:  # 20 tokens each: two of them fill the 32-token step budget
                await publish_work(js, "prefill", worker_id, work(name, 20))
            await wait_until(lambda: len(worker.ledger) >= num_pulled, f"{num_pulled} pulled", 10)
            await asyncio.sleep(0.5)  # the pull loop would have taken more by now if it were going to
            assert len(worker.ledger) == num_pulled
            release.set()
            await wait_until(lambda: finished == {"a", *names}, "every request finished", 30)
