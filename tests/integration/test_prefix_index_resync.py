"""The prefill-balancers' index of what lives where, over real nats-server and redis-server (+ the
kvcache service): a balancer started after the blocks were stored (a restart, or a new replica)
rebuilds the same index as the replica that saw every event, from `ferry.kv.resync`; a restarted
prefill worker's stale blocks are dropped ('cleared') from every replica; a warm-up that one replica
asked for ends up in every replica's index."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_kv_prefetch import LONG, TURN_1, serve, system  # noqa: F401
from test_prefix_reuse import clear_pool, client, tiny_model  # noqa: F401
from waiting import wait_until

from ferry.bus import connect
from ferry_services.prefill_balancer.service import PrefillBalancer
from ferry_services.prefill_balancer.settings import PrefillBalancerSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def contents(balancer: PrefillBalancer) -> dict:
    """(namespace, where, tier) -> set of hashes; order (recency) may differ between replicas."""
    return {key: set(held) for key, held in balancer.prefixes._held.items() if held}


def first_balancer(system) -> PrefillBalancer:
    return next(s.__self__ for s in system.stoppers if isinstance(getattr(s, "__self__", None), PrefillBalancer))


async def start_replica(nats_url) -> tuple[PrefillBalancer, object]:
    nc = await connect(nats_url, "ferry-test-replica")
    replica = PrefillBalancer(nc, PrefillBalancerSettings(tick_s=0.2))
    await replica.start()
    # it joins the submit queue group at once: until it has heard the prefill worker's load report, a request
    # it takes is refused with no_workers (what made this file's warm-up test fail now and then)
    await wait_until(lambda: replica.runtime.view.routable(time.monotonic()), "the replica sees the prefill worker")
    return replica, nc


async def test_a_late_replica_rebuilds_the_same_index(system, nats_url, client):
    await serve(client, "turn-1", TURN_1, LONG)
    seen_all = first_balancer(system)
    prefill = system.workers["prefill-t"]
    # the worker's pool, the store's prompt blocks and the decode worker's written-back output blocks
    expected_keys = {(prefill.namespace, prefill.worker_id, "device"), (prefill.namespace, "store", "remote")}
    await wait_until(
        lambda: expected_keys <= contents(seen_all).keys(), "the first balancer knows the pool and the store"
    )
    await wait_until(
        lambda: system.workers["decode-t"].num_written_back_blocks, "the decode worker wrote its output blocks back"
    )
    await asyncio.sleep(0.3)  # the write-back's store events reach the first balancer

    replica, nc = await start_replica(nats_url)
    try:
        await wait_until(
            lambda: contents(replica) == contents(seen_all), "the late replica's index equals the first one's"
        )
        assert len(contents(replica)[(prefill.namespace, "store", "remote")]) > len(TURN_1) // 16
    finally:
        await replica.stop()
        await nc.close()


async def test_a_restarted_worker_is_forgotten_by_every_replica(system, nats_url, client):
    await serve(client, "turn-1", TURN_1, LONG)
    prefill = system.workers["prefill-t"]
    key = (prefill.namespace, prefill.worker_id, "device")
    seen_all = first_balancer(system)
    replica, nc = await start_replica(nats_url)
    try:
        await wait_until(
            lambda: key in contents(replica) and key in contents(seen_all), "both replicas know the worker's pool"
        )
        await clear_pool(prefill)  # as after a restart: nothing in its pool
        await prefill.publish_pool_contents(cleared=True)  # what a worker says when it starts
        await wait_until(
            lambda: key not in contents(replica) and key not in contents(seen_all),
            "both replicas forgot the restarted worker's pool",
        )
    finally:
        await replica.stop()
        await nc.close()


async def test_replicas_agree_after_a_turn_end_warm_up(system, nats_url, client):
    """Only one replica takes a turn's KvWarm (queue group) and marks the warmed blocks in the prefill worker's
    host tier; the worker's host events bring every other replica to the same index, without waiting for its
    next step."""
    replica, nc = await start_replica(nats_url)
    try:
        await serve(client, "turn-1", TURN_1, LONG)
        prefill = system.workers["prefill-t"]
        await wait_until(lambda: prefill.prefetcher.stats.num_fetched_blocks, "the warm-up landed in the host tier")
        host = (prefill.namespace, prefill.worker_id, "host")
        seen_all = first_balancer(system)
        await wait_until(
            lambda: host in contents(replica) and contents(replica) == contents(seen_all),
            "both replicas hold the same index, the warmed host-tier blocks included",
        )
    finally:
        await replica.stop()
        await nc.close()
