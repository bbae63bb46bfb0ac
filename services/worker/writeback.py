"""Write-back at turn end (FERRY_KV_WRITEBACK): a finished sequence's full blocks go to the store, and a
`KvWarm` with the conversation's whole chain goes to the prefill-balancers, so that the next turn (which
re-sends prompt + output + a new message) finds its history in the store, prefetched into the worker
that will prefill it while the user thinks. Best effort, after the tokens went out.

A decode worker skips the prompt's blocks (the prefill worker stored them before the hand-off); a
both-roles worker stored nothing of it yet, so it asks the store how much of the chain it holds (one
lookup) and writes the rest.
"""

from __future__ import annotations

import logging
from typing import Any

from ferry.kvstore import KvStoreError
from ferry.protocol import GenerateRequest, KvWarm, encode, subjects

log = logging.getLogger(__name__)


async def write_back(worker: Any, sequence_id: str, request: GenerateRequest, skip_prompt: bool) -> int:
    """Store `sequence_id`'s full blocks past the prompt (`skip_prompt`) or past those the store holds,
    then publish its chain as a `KvWarm`; how many blocks were written."""
    skip = len(request.prompt_token_ids) // worker.settings.block_size if skip_prompt else 0
    taken = await worker.compute.call(worker.engine.take_finished_chain, sequence_id, skip)
    if taken is None:
        return 0
    chain, copy = taken
    data = await copy.result()  # the copy out of the pool, under way since the engine thread took it
    try:
        start = 0 if skip_prompt else await worker.store.lookup(chain)
        if skip + start < len(chain):
            await worker.store.put_blocks(chain[skip + start :], data[start:])
    except KvStoreError as exc:
        log.info("KV of %s not written back: %s", request.request_id, exc)
        return 0
    # the next turn starts with this chain: a prefill-balancer has it prefetched where that turn will go,
    # the decode-balancers credit this worker (it holds the chain) for decoding it
    warm = KvWarm(request.request_id, worker.namespace, chain, worker_id=worker.worker_id)
    await worker.nc.publish(subjects.KV_WARM, encode(warm))
    return max(0, len(chain) - skip - start)
