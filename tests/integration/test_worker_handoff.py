"""Offering a hand-off (`HandoffSender.offer`) over a real nats-server, against a scripted
decode-balancer on `ferry.handoff`: retried with exponential backoff (0.05 s, doubling, at most
1 s) until accepted, until the request is cancelled, or until the next try would start after the
timeout. Storing its KV (`store_kv`) on a real redis-server: only what the store lacks is written."""

from __future__ import annotations

import time

import pytest
import torch

from ferry.engine.kv_copy import OutCopy
from ferry.engine.outputs import PrefilledKV
from ferry.kvstore.redis_transport import RedisTransport
from ferry.kvstore.store import KvStore
from ferry.protocol import (
    HANDOFF_TOO_LONG,
    GenerateRequest,
    Handoff,
    HandoffReply,
    SamplingParams,
    decode,
    encode,
    hash_full_blocks,
    subjects,
)
from ferry_services.worker.handoff import HandoffSender

pytestmark = pytest.mark.integration


class Balancer:
    """Answers `ferry.handoff`: rejects the first `num_rejects` offers (for `reason`), then accepts."""

    def __init__(self, nc, num_rejects: int, reason: str = "overloaded") -> None:
        self.nc, self.num_rejects, self.reason = nc, num_rejects, reason
        self.arrivals: list[float] = []

    async def start(self) -> None:
        await self.nc.subscribe(subjects.HANDOFF, cb=self._on_offer)
        await self.nc.flush()

    async def _on_offer(self, msg) -> None:
        handoff = decode(msg.data, Handoff)
        self.arrivals.append(time.monotonic())
        accepted = len(self.arrivals) > self.num_rejects
        reply = HandoffReply(handoff.request.request_id, accepted, reason="" if accepted else self.reason)
        await msg.respond(encode(reply))


def handoff(request_id: str = "h") -> Handoff:
    request = GenerateRequest(request_id, "gw", "m", [1, 2, 3], SamplingParams(), output_token_ids=[7])
    return Handoff(request, "p", "ns", [], 0)


def sender(nc, cancelled: frozenset[str] | set[str] = frozenset()) -> HandoffSender:
    return HandoffSender(nc, store=None, worker_id="p", block_size=16, is_cancelled=cancelled.__contains__)


async def test_an_offer_is_retried_with_growing_delays_until_accepted(nc):
    balancer = Balancer(nc, num_rejects=3)
    await balancer.start()
    assert await sender(nc).offer(handoff(), timeout_s=10) == ""  # accepted
    assert len(balancer.arrivals) == 4
    gaps = [b - a for a, b in zip(balancer.arrivals, balancer.arrivals[1:])]
    for gap, delay_s in zip(gaps, (0.05, 0.1, 0.2)):
        assert delay_s <= gap < delay_s + 0.5, gaps


async def test_an_offer_gives_up_before_a_try_would_start_after_the_timeout(nc):
    balancer = Balancer(nc, num_rejects=1000)
    await balancer.start()
    start = time.monotonic()
    assert await sender(nc).offer(handoff(), timeout_s=0.5) == "overloaded"
    # tries at about 0, 0.05, 0.15, 0.35 s; the next (0.4 s later) would start after 0.5 s
    assert 3 <= len(balancer.arrivals) <= 4 and balancer.arrivals[-1] - start < 0.5


async def test_an_offer_stops_once_the_request_is_cancelled(nc):
    balancer = Balancer(nc, num_rejects=1000)
    await balancer.start()
    cancelled: set[str] = set()
    offers = sender(nc, cancelled)
    original = offers._offer_once

    async def offer_once(h):
        if len(balancer.arrivals) == 2:
            cancelled.add("h")  # the gateway cancels after two refusals
        return await original(h)

    offers._offer_once = offer_once
    assert await offers.offer(handoff(), timeout_s=10) == "overloaded"
    assert len(balancer.arrivals) == 3


async def test_with_no_balancer_at_all_the_offer_times_out(nc):
    start = time.monotonic()
    assert await sender(nc).offer(handoff(), timeout_s=0.3) == "no decode-balancer answered"
    assert time.monotonic() - start < 1.5


async def test_an_offer_no_decode_worker_could_ever_take_is_not_retried(nc):
    reason = f"{HANDOFF_TOO_LONG}: 70 tokens need 5 KV blocks, the largest decode worker's pool has 4"
    balancer = Balancer(nc, num_rejects=1000, reason=reason)
    await balancer.start()
    assert await sender(nc).offer(handoff(), timeout_s=10) == reason
    assert len(balancer.arrivals) == 1


def prefilled(tokens: list[int], block_size: int, fill: float) -> PrefilledKV:
    """A sequence's KV as the engine hands it over: every block filled with `fill`."""
    hashes = hash_full_blocks(tokens, block_size)
    num_blocks = -(-len(tokens) // block_size)
    data = torch.full((num_blocks, 2, 3), fill)  # [n, *block_shape]
    return PrefilledKV(list(range(num_blocks)), hashes, len(tokens), OutCopy(data))


@pytest.mark.parametrize("skip_stored", [True, False])
async def test_a_handoff_writes_only_what_the_store_lacks_and_the_decode_side_reads_it_whole(
    nc, redis_url, skip_stored
):
    store = KvStore(RedisTransport(redis_url), "ns-handoff")
    tokens = list(range(100, 150))  # 3 full blocks of 16 and a 2-token tail
    earlier = prefilled(tokens[:32], 16, fill=1.0)  # an earlier turn stored the first two blocks
    await store.put_blocks(earlier.block_hashes, earlier.copy.wait())
    request = GenerateRequest("h", "gw", "m", tokens, SamplingParams())
    offers = HandoffSender(nc, store, "p", 16, is_cancelled=lambda _: False, skip_stored=skip_stored)

    out = await offers.store_kv(request, [7], prefilled(tokens, 16, fill=2.0))

    assert [ref.num_tokens for ref in out.kv_blocks] == [16, 16, 16, 2] and out.num_kv_tokens == 50
    data = await store.get_blocks([ref.block_hash for ref in out.kv_blocks])  # what the decode worker reads
    assert data is not None and data.shape == (4, 2, 3)
    # skipped: the stored blocks (equal KV in a real engine) are not rewritten; the rest is written
    assert [float(block[0, 0]) for block in data] == ([1.0, 1.0] if skip_stored else [2.0, 2.0]) + [2.0, 2.0]
    assert offers.num_blocks_skipped == (2 if skip_stored else 0)
