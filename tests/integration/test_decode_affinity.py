"""Decode-side session affinity over real nats-server and redis-server (+ the kvcache service): the
next turn of a conversation is decoded by the worker that decoded (and still holds) the last one, when
the decode workers are equally loaded, and elsewhere once that worker is busier: a preference, not a pin."""

from __future__ import annotations

import pytest
from test_kv_prefetch import LONG, serve, system  # noqa: F401
from test_prefix_reuse import client, tiny_model  # noqa: F401
from waiting import wait_until

from ferry.protocol import SamplingParams, hash_full_blocks

pytestmark = [pytest.mark.integration, pytest.mark.slow]

X = [(7 * i + 5) % 200 + 3 for i in range(74)]
Y = [(11 * i + 2) % 200 + 3 for i in range(74)]
FILLER = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)


def decode_balancer(system):
    return next(b for b in system.balancers if type(b).__name__ == "DecodeBalancer")


def decoded_by(client, request_id: str) -> str:
    (worker_id,) = client.workers_seen[request_id] - {"prefill-t"}
    return worker_id


async def until_affine(system, worker_id: str, history: list[int]) -> None:
    """The turn's KvWarm (its whole chain, from the worker that decoded it) reached the decode-balancer."""
    chain = hash_full_blocks(history[:-1], 16)
    affinity = decode_balancer(system).affinity
    await wait_until(lambda: affinity.leading(worker_id, chain) == len(chain), f"{worker_id} credited the chain")


async def test_next_turn_goes_to_the_warm_decode_worker_at_equal_load(system, client):
    await system.start_worker("decode", "decode-u", host_kv_blocks=64)
    await system.until_reported()
    # two conversations at once: the balancer spreads them, one per decode worker
    assert (await client.submit("x-1", X, LONG)).accepted
    assert (await client.submit("y-1", Y, LONG)).accepted
    await client.wait_finished(["x-1", "y-1"])
    warm = {c: decoded_by(client, f"{c}-1") for c in ("x", "y")}
    assert set(warm.values()) == {"decode-t", "decode-u"}
    histories = {"x": X + client.tokens["x-1"], "y": Y + client.tokens["y-1"]}
    for c in ("x", "y"):
        await until_affine(system, warm[c], histories[c])
    await system.until_reported()  # both idle again
    # one at a time, at equal (idle) load, first the one warm on decode-u: without affinity the tie
    # (equal KV usage, no sequence running) goes to decode-t
    for c in sorted(warm, key=lambda c: warm[c], reverse=True):
        await serve(client, f"{c}-2", histories[c] + [21, 22, 23])
        assert decoded_by(client, f"{c}-2") == warm[c], c


async def test_a_busy_warm_worker_loses_the_next_turn_to_an_idle_one(system, client):
    await system.start_worker("decode", "decode-u", host_kv_blocks=64)
    await system.until_reported()
    history = X + await serve(client, "x-1", X, LONG)
    warm = decoded_by(client, "x-1")
    await until_affine(system, warm, history)
    await system.until_reported()
    # branches of the same conversation, one after the other, each running long: the warm worker takes
    # them until its load outweighs the affinity credit, then the other one does
    routed = []
    for i in range(4):
        request_id = f"x-2-{i}"
        assert (await client.submit(request_id, history + [30 + i], FILLER)).accepted
        await wait_until(lambda r=request_id: len(client.workers_seen.get(r, ())) == 2, f"{request_id} decoding")
        routed.append(decoded_by(client, request_id))
    assert routed[:2] == [warm, warm], routed  # without affinity the second would go to the idle worker
    assert set(routed) == {"decode-t", "decode-u"}, routed
    await client.wait_finished([f"x-2-{i}" for i in range(4)], timeout_s=120)
