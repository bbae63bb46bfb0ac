"""A hand-off's KV through a real Redis held back mid-call: the engine threads keep stepping while the
store write and the store read are stuck (they wait on the I/O side, never on the engine thread), the
blocks read back are byte-identical to the ones taken, and the sequence staged from them decodes
token-identically to one engine running it start to finish (its blocks are not read before they
landed)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch
from engine_steps import run_to_end

from ferry.engine import EngineConfig, LLMEngine
from ferry.kvstore import KvStore, RedisTransport
from ferry.model import load_model
from ferry.protocol import GenerateRequest, SamplingParams
from ferry_services.worker.compute import ComputeThread
from ferry_services.worker.handoff import HandoffSender

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
PROMPT = [(5 * i + 11) % 250 + 3 for i in range(40)]
STEPS_WHILE_STUCK = 5
TIMEOUT_S = 60.0


class GatedTransport:
    """The real Redis transport whose bulk reads and writes wait at a gate the test opens: a store as
    slow as the test wants, without a timed test."""

    def __init__(self, inner: RedisTransport) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def _held(self) -> None:
        self.waiting.set()
        await self.gate.wait()
        self.gate.clear()
        self.waiting.clear()

    async def set_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        await self._held()
        await self.inner.set_many(items)

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        await self._held()
        return await self.inner.get_many(keys)

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.exists_many(keys)

    async def delete_many(self, keys: Sequence[str]) -> None:
        await self.inner.delete_many(keys)

    async def close(self) -> None:
        await self.inner.close()


async def step_while_stuck(compute: ComputeThread, transport: GatedTransport, call: asyncio.Task) -> None:
    """Wait until `call` is stuck in the store, run engine steps meanwhile, then let it through."""
    await asyncio.wait_for(transport.waiting.wait(), TIMEOUT_S)
    for _ in range(STEPS_WHILE_STUCK):
        await asyncio.wait_for(compute.call(compute.engine.step), TIMEOUT_S)
        assert not call.done(), "the store call finished while held"
    transport.gate.set()
    await asyncio.wait_for(call, TIMEOUT_S)


async def test_the_engine_steps_while_the_store_holds_a_hand_off_and_the_blocks_arrive_intact(
    tiny_checkpoint, redis_url, redis
):
    lm = load_model(tiny_checkpoint)
    whole = LLMEngine(lm, EngineConfig(num_kv_blocks=64))
    whole.add_request("a", PROMPT, GREEDY)
    expected = run_to_end(whole, "a")

    prefill = ComputeThread(LLMEngine(lm, EngineConfig(num_kv_blocks=64, role="prefill")))
    decode = ComputeThread(LLMEngine(lm, EngineConfig(num_kv_blocks=64)))
    transport = GatedTransport(RedisTransport(redis_url))
    store = KvStore(transport, prefill.engine.kv_namespace)
    try:
        await prefill.call(prefill.engine.add_request, "a", PROMPT, GREEDY)
        first = (await prefill.call(prefill.engine.step))[0].new_token_ids
        await decode.call(decode.engine.add_request, "busy", PROMPT[::-1], LONG)  # the batch that keeps stepping
        kv = await prefill.call(prefill.engine.take_prefilled, "a")

        sender = HandoffSender(None, store, "p", 16, is_cancelled=lambda _: False)  # type: ignore[arg-type]
        request = GenerateRequest("a", "gw", "m", PROMPT, GREEDY)
        put = asyncio.create_task(sender.store_kv(request, first, kv))
        await step_while_stuck(prefill, transport, put)  # the prefill engine steps during the write
        handoff = put.result()
        assert handoff.num_kv_tokens == len(PROMPT)

        get = asyncio.create_task(store.get_blocks([b.block_hash for b in handoff.kv_blocks]))
        await step_while_stuck(decode, transport, get)  # the decode batch steps during the read
        data = get.result()
        assert data is not None and torch.equal(data, kv.data)  # byte-identical (same dtype, same values)

        staged = decode.engine.stage_kv(data)  # on the I/O side, as the decode worker does
        await decode.call(decode.engine.add_prefilled, "a", PROMPT, first, GREEDY, staged, kv.num_tokens)
        rest = await decode.call(run_to_end, decode.engine, "a")
        assert first + rest == expected
    finally:
        prefill.close()
        decode.close()
        await transport.close()
